"""The CLI's subcommands, one module each, thin over the library (cli.py registers them):

    convert, build-engine, import-gguf, make-tiny   artifacts: checkpoints (checkpoint/), engines (backends/)
    run                                             decode with an engine (runtime/, or backends/trtllm.py)
    make-repo, serve, generate                      serving through tritonserver and the OpenAI API (serving/)
    bench, bench-engine, gate                       measuring (served, and the engine alone) and the CI gate
                                                    (bench/)
    train-drafter                                   distilling a drafter (training/)
"""
