"""The torch engine: what runs an engine directory, on the CPU or CUDA, at TP 1 or under mpirun.

One request's way through it: a `sequence.RequestSpec` (prompt, sampling, mode, proposer, stops), made where it
enters and carried as is; `scheduler.Scheduler` queues it (`scheduler.Request`: the spec, one id, where its tokens
go) and batches it in flight -> `engine.Engine` admits it into a batch slot (`sequence.Sequence` on the host,
`state.SlotState` rows and `kv_cache.PagedKVCache` blocks on the device), prefills it, then runs batched steps:
`policy.Policy` decides each step (an AR step, or how many nodes of each draft tree to verify, by the measured
`policy.CostModel` and the proposer's calibrated confidence), and
`step.DecodeStep` runs it (verify -> accept -> rewind -> draft -> pack) as one compiled or captured unit
(`graphs`). Proposers (`proposer`, `ngram`) fill the trees. The engine directory's schema is
`checkpoint.engine_config`.

    engine         load an engine directory; admit, step, finish requests
    scheduler      in-flight batching: a queue in front of the engine; TP plans broadcast to the other ranks
    generate       offline generation of a list of prompts through the scheduler
    step           the batched decode step, phase by phase, no host sync inside
    state          the device-side decoding state, one row per batch slot
    kv_cache       the paged KV cache and its block tables
    policy         the speculation policy: cost model, calibration, per-step decision
    proposer       the proposer interface and the device drafter's beam search (ReDrafter, mixed)
    ngram          learning-free proposers: context and model N-grams
    sequence       RequestSpec; per-request host state and statistics
    graphs         eager, torch.compile, CUDA graphs
    distributed    the TP process group (MPI ranks, torch.distributed collectives), mpirun commands
    timing         per-phase step timing
"""
