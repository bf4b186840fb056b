"""Checks built around other pipeline engines, one module each (import the one you use).

    from pipecheck.engines import deepspeed, torchtitan
    deepspeed.check(layers=[LayerSpec(nn.Linear, 8, 8), ...], inputs=x, num_stages=2)
    torchtitan.check(make_model, (tokens,), module_names_per_stage=[["tok_embeddings", "layers.0"], ...])

Each needs its engine installed (``pip install "pipecheck[deepspeed]"``,
``"pipecheck[torchtitan]"``); importing this package imports neither.
The same engines also run any model pipecheck splits:
``pc.assert_equivalent(model, args, runner="deepspeed")`` or ``runner="torchtitan"``.
"""
