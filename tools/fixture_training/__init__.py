"""Train the *text* fixtures: small models with an MTP head, on real text.

The bundled ``tiny-qwen35-*`` fixtures learn a synthetic Markov language that every head, even
a broken one, drafts at ~100% greedy acceptance. These learn Python source code and its
docstrings: the pure-Python modules of CPython's standard library (PSF License), which every
CPython 3.10-3.12 install has on disk, so the corpus needs no download. Their MTP heads accept
a realistic share of drafts, and a broken conversion shows.

Steps (each a sub-command of ``python -m tools.fixture_training``, run from the repository root):

    prepare   read the corpus from this interpreter's stdlib, train a byte-level BPE tokenizer
              (``tokenizers``), write token ids and a manifest (file list, SHA-256s) to STAGE
    train     train one variant with PyTorch and transformers' own classes (CUDA when there is
              one), the MTP head trained next to the backbone; write checkpoints (bf16, A_log and
              the gated norm in f32, as the release stores them) and a log. Needs only torch,
              transformers, safetensors and numpy: it runs on an MLX-free box.
    export    write a checkpoint as the raw Hugging Face layout (``model.language_model.*``,
              top-level ``mtp.*``, zero-centred norms, ``[C,1,K]`` conv1d; the MoE backbone's
              experts fused and the MTP layer's per expert, as Qwen3.5 MoE is published) plus
              config, tokenizer and training.json
    parity    transformers' forward (torch, CPU) of the raw folder against MLX on its conversion

``--variant dense|moe`` is a Qwen3.5 model (qwen3_5.py). ``--variant next`` trains, exports and
checks a Qwen3-Next MoE model instead (transformers' ``Qwen3NextForCausalLM``, same tokenizer and
stage, the published flat ``model.*`` layout in two shards with ``mtp.*`` in the last):
qwen3_next.py. ``--variant glm5`` (train, export) and ``parity`` of a ``glm_moe_dsa`` folder run
the glm package: a GLM-5.x model (transformers' ``GlmMoeDsaForCausalLM``, MLA, MoE, DSA indexer)
with a nextn head, same stage, GLM-5's raw layout; its own command line,
``python -m tools.fixture_training.glm``, has more options.

The MTP head is ``fc(concat[pre_fc_norm_embedding(embed(t+1)), pre_fc_norm_hidden(h_t)])``, one
full-attention decoder layer (dense MLP or MoE, like the backbone's), ``norm``, and the shared
``lm_head``; ``h_t`` is the backbone's post-final-norm state. Loss: next-token cross-entropy
plus the head's cross-entropy on token t+2 (plus a small router load-balancing term for MoE).

    python -m tools.fixture_training prepare --stage /tmp/stage
    python -m tools.fixture_training train --stage /tmp/stage --variant dense --out /tmp/run-dense \\
        --time-budget 330
    python -m tools.fixture_training export --stage /tmp/stage --run /tmp/run-dense --variant dense \\
        --out mtpconvert/fixture/data/text-qwen35-mtp
    python -m tools.fixture_training parity mtpconvert/fixture/data/text-qwen35-mtp
    python -m tools.fixture_training train --stage /tmp/stage --variant next --out /tmp/run-next --steps 1000
    python -m tools.fixture_training export --stage /tmp/stage --run /tmp/run-next --variant next
    python -m tools.fixture_training parity mtpconvert/fixture/data/text-qwen3next-mtp --stage /tmp/stage

The modules: corpus (the stage: corpus, tokenizer, token ids), heads (the Qwen-style MTP head and
the losses), training (the run scaffold every variant's train loop uses), folders (what the
exports and parity checks share: checkpoints, shards, records), then one module per variant
(qwen3_5, qwen3_next, the glm package) and the command line (__main__). A variant imports these,
never the reverse. torch and mlx are imported inside the functions that use them: ``train`` runs on an
MLX-free box, the GLM head's mlx-vlm check in a venv without torch. The bundled fixtures' training.json and README.md record the commands as they
were run, under the former script names ``tools/train_text_fixture.py`` (this package's command
line) and ``tools/train_text_fixture_glm.py`` (the glm package's).
"""
