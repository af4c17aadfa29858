"""The Qwen3.8-Flash-Next (``qwen4_exp``) text fixture ``text-qwen4_exp-mtp``.

The backbone is transformers' own ``Qwen4ExpForCausalLM`` (``model.TEXT``): hidden size 96, four hyper-connection
streams, GatedDeltaNet in layers 0-2 and indexed attention in layer 3, MoE with a shared expert in every layer, a
per-layer n-gram embedding in layer 1. The indexers' budget (256) exceeds every trained and tested length, so their
selection is every visible key; ``model.dense_indexers`` computes that mask at once instead of transformers'
per-query loop and ``model.check_dense_indexer`` compares the two before training. The indexers are not trained
(their selection has no gradient); their q/k norms are drawn around 0 so that they are not all-zero tensors.

The MTP head is the release's design as mlx-vlm 0.7.10's ``qwen4_exp_mtp`` drafter runs it (``model.make_head``),
built from transformers' qwen4_exp modules: ``fc_embedding(pre_fc_norm_embedding(embed(t+1)))`` added to
``fc_hidden`` of each hyper-connection stream of ``pre_fc_norm_hidden(h_t)``, one decoder layer, its own
``hyper_connection_mixer``, the shared ``lm_head``. Its norms start with gains spread log-uniform in [1/3, 3] so
that a norm shifted by a wrong conversion rule changes what the head computes. It is trained next to the backbone
on token t+2 (plus a router balancing term), on the same stage (corpus, tokenizer, token ids) as the other text
fixtures.

export writes the raw release layout: ``Qwen4ExpForConditionalGeneration.save_pretrained`` of the weights (an
untrained one-block vision tower included), ``mtp.*`` in the last shard, bf16 but the int64 n-gram hashing buffers;
it reads the folder back through ``from_pretrained`` and measures the head's acceptance in torch (greedy, teacher-
forced, three broken heads) into training.json and README.md; acceptance measures a written folder again. check
converts the folder with ``mtpconvert convert`` (float32 and 4-bit), runs our smoke on it and on the conversions
``broken.py`` makes, and mlx-vlm's drafter on ``OUT/mtp``; it records those numbers too.

To make the folder again (the shipped one: 330 s of training on one H200, ``--device cuda``; the same command
with ``--device cpu --threads 2 --steps 3594`` trains the same number of steps on a CPU, far more slowly):

    python -m tools.fixture_training prepare --stage /tmp/stage
    python -m tools.fixture_training.qwen4_exp train --stage /tmp/stage --out /tmp/run-q4x --device cuda \\
        --time-budget 330 --batch 32 --seq 128 --warmup 100 --logs 40 --eval-every 4 --save-at
    python -m tools.fixture_training.qwen4_exp export --stage /tmp/stage --run /tmp/run-q4x \\
        --commands "python -m tools.fixture_training prepare --stage STAGE" "..."
    python -m tools.fixture_training.qwen4_exp acceptance mtpconvert/fixture/data/text-qwen4_exp-mtp --stage /tmp/stage
    python -m tools.fixture_training.qwen4_exp check mtpconvert/fixture/data/text-qwen4_exp-mtp

Modules: model (config, model, head, forward), train, export (layout and torch acceptance), broken (MLX folders
broken on purpose), check (the consumers' numbers), readme, __main__ (this command line).
"""
