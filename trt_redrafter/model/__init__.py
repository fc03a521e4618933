"""The model math, one tensor-parallel rank of it, loaded from TensorRT-LLM checkpoint tensors.

    llama      the Llama decoder rank (embedding, layers, final norm, output head) over a paged KV cache
    attention  tree attention over the paged KV cache (the torch oracle; the CPU and CUDA kernels share its contract)
    drafter    the ReDrafter drafter head rank (RNN state, ResBlocks, vocabulary or draft-vocabulary head)
    linear     the CPU linear layers: AVX-512 over packed weights, oneDNN, or torch
    tp         this rank, the group size, its device and the collectives, as the model sees them
"""
