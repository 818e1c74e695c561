"""The jobs a command runs, above the stages they call:
    builders.py       config → objects: the target (`build_target`), the head (`build_draft`), run metadata
    training_job.py   a head trained, saved, evaluated and exported (`run_training_job`: `peagle train`
                      and the dry run)
    dry_run.py        `dry_run=true`: a recipe checked on a tiny stand-in target
    sweep_summary.py  the table and plot over the jobs of a Hydra multirun sweep (`SweepSummary`)
"""
