"""kvfleet benchmarks: ratios against baselines measured in the same run (not tests).

Run ``python -m bench`` (README: ``bash run.sh bench``) to list them, ``python -m bench NAME``
to run one.
"""
