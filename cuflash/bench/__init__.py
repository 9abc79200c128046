"""Benchmarks behind ``python -m cuflash bench``: cuflash timed next to its peers. Tooling: the product
never imports it."""
