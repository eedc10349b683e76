"""Image RL training: the LoRA policy (``policy``), the trainer and its exact accumulation rule
(``trainer``), the objectives (``flow_grpo``, ``nft``, by name in ``objective``), the
single-process policy worker (``local_worker``) and the step backend (``backend``) that
``diffusionrl.run.loop.RunLoop`` drives. ``diffusionrl.train.train`` builds and runs it."""
