"""task=pipeline: one model trained through a protocol's stages, each from the previous stage's last.ckpt, then
evaluated; one pipeline per job of a multirun (a table's rows).

    python run.py task=pipeline protocol=smoke                                          # CPU, minutes
    python run.py -m task=pipeline protocol=paper_ablation sweep=paper_agt_mlp_conv      # one pipeline per row
    python run.py task=pipeline protocol=smoke pipeline.resume=<run dir>                 # continue it

Settings (`pipeline.*`, conf/pipeline/default.yaml; a protocol of conf/protocol/ fills them):

- `stages`: in order; each an experiment name (`chairs` = the stage `chairs` with the overrides
  `[experiment=chairs]`) or `{name: <folder>, overrides: [...]}`. Stage i is the training run (task=train or
  task=pretrain) `python run.py <shared> <stage overrides> <row> model.init_from=<stage i-1>/checkpoints/last.ckpt`
  written to `<run dir>/<stage>/`, with this job's seed, name and logger; the first stage starts from what its
  overrides say.
- `evaluate`: `{label: [overrides]}`; each label is a task=eval run of the last stage's last.ckpt, with the last
  stage's backbone, in `<run dir>/eval_<label>/` (e.g. `plain` and `tiled`).
- `shared`: overrides every stage and evaluation starts with.
- `row`: a table row's overrides. They are added to the job's own command-line overrides (a sweep's `params`),
  except those that set up the pipeline job itself (task, name, seed, logger, experiment, protocol, sweep,
  pipeline.*, hydra.*). A row's override goes to every stage and evaluation (the network is the same through
  the protocol), except that `model.<key>` goes only where the stage's model has `<key>` (`model.mask_ratio`
  to the MCVA stage, `model.optimizer.lr` everywhere) and `model=<name>` only to the pretraining stages (a row
  chooses the pretraining objective; the supervised stages stay `model=flow`). What a stage did not take is
  listed in its record (`dropped`).
- `resume`: the run directory of an earlier run of the same pipeline (in a multirun: its sweep directory,
  each job finds its own). Finished stages are skipped, an interrupted stage resumes exactly from its
  last.ckpt (`ckpt_path`; its earlier directory is kept as `<stage>.interrupted[-n]`), unfinished evaluations
  run. A finished stage whose checkpoint is missing or changed, or whose overrides differ from this run's, is
  refused in one line: no stage starts from a stale or missing checkpoint.

Each stage start is one line, `pipeline: stage i/N <name> ...`. A stage that fails stops the pipeline with one
line naming it (PipelineStageError); the finished stages and their record are kept.

The record, `<run dir>/pipeline.json` (rewritten atomically at every change; task=report reads it)::

    {
      "version": 1,
      "run_dir": "<absolute run dir>",
      "name": "<cfg.name>",
      "status": "running" | "done" | "failed" | "stopped",
      "row": ["backbone.intra_layer=mlp", ...],          # this job's row overrides
      "metric": <float or null>,                        # what run.py returns: the first evaluation's epe
      "stages": [
        {
          "name": "chairs", "index": 1, "dir": "<run dir>/chairs",
          "task": "train" | "pretrain",
          "overrides": [...],                           # exactly what the stage was composed from, minus seed,
                                                        # name, logger and paths (its command line)
          "dropped": [...],                             # row overrides this stage did not take
          "init_from": "<previous last.ckpt>" | null,
          "status": "pending" | "running" | "done" | "failed" | "stopped",
          "checkpoint": "<dir>/checkpoints/last.ckpt" | null,
          "checkpoint_sha256": "<hex>" | null,
          "resumed_from": ["<dir>.interrupted/checkpoints/last.ckpt", ...],
          "wall_s": <seconds, all attempts> | null,
          "metrics": {"train/loss": ..., "val/synthetic/epe": ...},   # the trainer's last logged values
          "error": "<one line>" | null
        }, ...
      ],
      "evaluations": [
        {
          "label": "plain", "dir": "<run dir>/eval_plain", "overrides": [...], "dropped": [...],
          "status": "pending" | "running" | "done" | "failed" | "stopped",
          "checkpoint": "<last stage's last.ckpt>",
          "results_json": "<dir>/eval_results.json",    # task=eval's results (flowformer/tasks/eval.py)
          "wall_s": <seconds> | null, "error": "<one line>" | null
        }, ...
      ]
    }
"""
