"""The torch engine: what runs an engine directory, on the CPU or CUDA, at TP 1 or under mpirun.

One request's way through it: a `sequence.RequestSpec` (prompt, sampling, mode, proposer, stops), made where it
enters and carried as is; `scheduler.Scheduler` queues it (`scheduler.Request`: the spec, one id, where its tokens
go) and batches it in flight -> `engine.Engine` admits it into a batch slot (`sequence.Sequence` on the host,
`state.SlotState` rows and `kv_cache.PagedKVCache` blocks on the device), prefills it, then runs batched steps:
`policy.Policy` decides each step (an AR step, or how many nodes of each draft tree to verify, by the measured
`costs.CostModel` and the proposer's `calibration`), `launch.StepLauncher` launches it and `step.DecodeStep` computes
it (verify -> accept -> rewind -> draft -> pack) as one compiled or captured unit (`graphs`). Proposers
(`proposer`, `ngram`) fill the trees. The engine directory's schema is `checkpoint.engine_config`.

    engine         an engine directory's rank: admit, step, finish requests
    loading        what an engine settles at load: kernels, drafter dtype, KV cache, inductor's cache, proposers
    launch         the step variants, their inputs, compiled units and warm-up
    scheduler      in-flight batching: a queue in front of the engine; TP plans broadcast to the other ranks
    generate       offline generation of a list of prompts through the scheduler
    step           the batched decode step, phase by phase, no host sync inside
    state          the device-side decoding state, one row per batch slot
    kv_cache       the paged KV cache and its block tables
    policy         the speculation policy's per-step decision
    costs          the step cost model: measured, cached beside the engine
    calibration    P(accepted | a proposer's score), learned from verified nodes
    proposer       the proposer interface (ReDrafter, mixed) and what the engine asks of it
    drafter        the device drafter's beam search
    ngram          learning-free proposers: context and model N-grams
    sequence       RequestSpec; per-request host state and statistics; trees as nodes and as beams
    graphs         eager, torch.compile, CUDA graphs; batch and tree-width buckets
    distributed    the TP process group (MPI ranks, torch.distributed collectives), mpirun commands
    timing         step times by kind, per-phase step timing
"""
