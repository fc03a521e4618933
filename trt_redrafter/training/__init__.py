"""Training a small real base model and distilling a ReDrafter drafter from any HF Llama base.

`data` holds the offline text (the Python standard library's sources) and tokenizer training; `drafter_training`
the drafter distillation (the base model generates its own greedy continuations; the drafter learns its
predictions) and the Apple-format writer.
"""
