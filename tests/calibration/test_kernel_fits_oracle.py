"""The kernel fits' held-out machinery and the all-reduce curve, on numbers worked by hand.

``holdout_predictions`` must predict each fold from a fit that never saw it: with a "fit"
that is the mean of its rows, fold A's prediction is the mean of the other folds' rows,
written out here. ``relative_errors`` is relative to the measurement. ``interpolate_s``
follows the all-reduce curve's rule: the first time below the smallest size, linear
between points, the last segment's slope above the largest (one point: proportional).
"""

import numpy as np
import pytest

from kvtwin.sim.calibration.fit.kernels import holdout_predictions, interpolate_s, relative_errors


def test_each_fold_is_predicted_by_a_fit_on_the_others():
    seconds = np.array([1.0, 2.0, 3.0, 10.0, 20.0, 100.0])
    folds = np.array([0, 0, 0, 1, 1, 2])

    def fit(mask):
        return float(np.mean(seconds[mask]))

    predicted = holdout_predictions(fit, lambda mean, mask: np.full(int(mask.sum()), mean), folds)
    # Fold 0 from rows 10, 20, 100; fold 1 from 1, 2, 3, 100; fold 2 from the first five.
    assert predicted.tolist() == pytest.approx([130 / 3] * 3 + [106 / 4] * 2 + [36 / 5])


def test_relative_errors_are_relative_to_the_measurement():
    assert relative_errors([1.1, 0.5, 3.0], [1.0, 1.0, 2.0]).tolist() == pytest.approx([0.1, 0.5, 0.5])


def test_the_curve_between_below_and_above_its_points():
    sizes, times = (1e3, 1e5, 1e6), (1e-5, 3e-5, 1.2e-4)
    query = np.array([10.0, 1e3, 5.05e4, 5.5e5, 1e6, 2e6])
    slope = (1.2e-4 - 3e-5) / (1e6 - 1e5)
    expected = [1e-5, 1e-5, 1e-5 + (3e-5 - 1e-5) * (5.05e4 - 1e3) / (1e5 - 1e3),
                3e-5 + (1.2e-4 - 3e-5) * (5.5e5 - 1e5) / (1e6 - 1e5), 1.2e-4, 1.2e-4 + slope * 1e6]
    assert interpolate_s(sizes, times, query).tolist() == pytest.approx(expected, rel=1e-12)
    assert interpolate_s((1e3,), (1e-5,), np.array([10.0, 4e3])).tolist() == pytest.approx([1e-5, 4e-5])
