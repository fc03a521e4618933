"""trt-redrafter: ReDrafter speculative decoding engines for Llama/Vicuna, served by Triton, measured against AR."""

__version__ = "0.1.0"
