"""Data files of the replay clock: bundled cost-model calibrations per GPU
(``calibration/``) and the public measurements they were fitted on (``measurements/``)."""
