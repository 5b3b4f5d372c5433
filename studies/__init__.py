"""The lab beside the training repository: the paper's comparisons at laptop scale as named studies of
train.py runs, their runner, reports and plots (`python -m studies NAME`; studies/README.md), and their
committed records (studies/results/). It reaches train.py and export.py only through their command
lines and run directories."""
