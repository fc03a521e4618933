"""Training a small real base model and distilling a ReDrafter drafter from any HF Llama base.

    config             DrafterTrainConfig: train-drafter's settings, flags and checks (one ConfigBase)
    prompts            where the corpus's prompts come from: text windows, a JSONL, Magpie self-prompts; the
                       MT-Bench guard that keeps the evaluation set out
    generation         the base writes the corpus: the project's batched engine (default) or HF `generate`
    corpus             corpus shards on disk (hidden states, tokens, targets), streamed back while training
    sources            each split's prompts and corpus, the generator started on demand, the draft vocabulary
    loop               the training loop (DDP under torchrun, checkpoints, resume), held-out evaluation and the
                       Apple-format writer; the drafter module is model.drafter.Drafter
    data               the offline text (the Python standard library's sources) and tokenizer training of
                       scripts/train_base.py
"""
