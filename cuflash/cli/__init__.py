"""The command line behind ``python -m cuflash``. Tooling: the product never imports it."""
