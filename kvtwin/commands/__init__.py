"""One module per `kvtwin` command; `kvtwin.cli` wires them into one typer app."""
