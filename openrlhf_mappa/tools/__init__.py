"""The tools around training: the `mappa` command (mappa.py) and what only its commands run (the doctor, the
report, the paper table, DSBench's import, the tiny model, the coach's distillation and re-scoring). They may
import the core; the core (what a training run imports) never imports them (tests/test_imports.py)."""
