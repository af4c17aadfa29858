"""The Nemotron-H (``nemotron_h``) text fixture ``text-nemotronh-mtp``.

The backbone is transformers' own ``NemotronHForCausalLM`` with Nemotron-3 Super's block kinds: Mamba2 blocks,
latent MoE blocks (8 routed relu² experts, top 2, sigmoid routing whose ``e_score_correction_bias`` is balanced
the auxiliary-loss-free way, one shared expert, ``fc1``/``fc2_latent_proj``) and one attention block (no RoPE).
It is trained on the same stage (corpus, tokenizer, token ids) as the other text fixtures.

The MTP head is Super's prediction module of the blocks ``"*E"`` (``mtp_hybrid_override_pattern``):
``x = eh_proj(concat[enorm(embed(t+1)), hnorm(h_t)])`` with ``h_t`` the backbone's state after ``norm_f``, an
attention block, a latent MoE block, ``final_layernorm``, and the backbone's ``lm_head`` (transformers' own
``NemotronHModel`` over the head's pattern holds the blocks: model.py). Plain RMSNorms (``x * w``). It is trained
next to the backbone to predict token t+2. A run can stop after ``--chunk-seconds`` and continue from
``OUT/resume.pt`` when started again with the same arguments (exit status 3 until it is done).

head retrains that head on a folder's frozen backbone with a contrast term that makes the converter mistakes a
real Super's head would not survive (its blocks in the other order, its latent projections transposed) collapse the
fixture's acceptance too: a head trained only to predict came out with blocks that nearly commute (head.py says
how and why). The fixture's head is that run's.

export writes the release layout: ``backbone.*`` as transformers' ``save_pretrained`` names it (every expert one
by one, ``mixer.experts.{e}.{up,down}_proj.weight``, conv1d ``[C, 1, K]``), ``mtp.layers.{j}.*`` with ``enorm``,
``hnorm``, ``eh_proj`` on block 0 and ``final_layernorm`` on block 1 alone in the last shard,
``e_score_correction_bias`` in F32 and every other tensor in bf16, and Super's config.json (pattern strings,
``num_nextn_predict_layers`` 1). It then measures the head's acceptance in torch on the written folder (greedy
k=1 with a bootstrap interval over prompts, teacher-forced, and the broken conversions tests/test_nemotron_h.py
makes), compares mlx-lm's float32 logits on the folder with transformers', and writes training.json and README.md.
mlx-vlm runs the folder's head as mlx-vlm 0.7.10's ``nemotron_h_mtp`` drafter (root-folder route) and measures
its greedy acceptance (no torch needed).

    python -m tools.fixture_training prepare --stage /tmp/stage
    python -m tools.fixture_training.nemotron_h train --stage /tmp/stage --out /tmp/run-nemotron --steps 600
    python -m tools.fixture_training.nemotron_h export --stage /tmp/stage --run /tmp/run-nemotron
    python -m tools.fixture_training.nemotron_h head --stage /tmp/stage --out /tmp/run-head --steps 400 --warmup 40 \
        --lr 1e-3 --source mtpconvert/fixture/data/text-nemotronh-mtp
    python -m tools.fixture_training.nemotron_h export --stage /tmp/stage --run /tmp/run-head
    python -m tools.fixture_training.nemotron_h mlx-vlm mtpconvert/fixture/data/text-nemotronh-mtp --stage /tmp/stage

Modules: model (config, model, names and layout), train, head (the head's contrast retraining), export (export,
acceptance, mlx-lm against transformers,
records), vlm_drafter (the mlx-vlm check), __main__ (this command line).
"""
