"""The project's tools, behind ``python -m flash_attention <command>``: bench, build, autotune, report, debug,
sanity, demo and the tile simulator.

They import the library; the library never imports them (tests/test_layers.py checks both the imports and
that no import cycle exists).
"""
