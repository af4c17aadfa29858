"""The GLM-5 (``glm_moe_dsa``) text fixture ``text-glm5-mtp`` (``--variant glm5``).

The backbone is transformers' own ``GlmMoeDsaForCausalLM``: 4 layers, layer 0 dense
(``first_k_dense_replace`` 1) and layers 1-3 MoE (8 routed experts, top 2, sigmoid ``noaux_tc`` routing with
``e_score_correction_bias``, 1 shared expert), MLA attention (``q_lora_rank``, ``kv_lora_rank``, split
nope/rope heads) and a DSA indexer in every layer whose ``index_topk`` (256) keeps it dense up to 256 tokens.
It is trained on the same stage (corpus, tokenizer, token ids) as the Qwen3.5 text fixtures.

The MTP ("nextn") head is GLM-5's / DeepSeek-V3's: ``h' = eh_proj(concat[enorm(embed(t+1)), hnorm(h_t)])``
with ``h_t`` the backbone's state after ``model.norm`` and ``embed`` the backbone's ``embed_tokens`` (GLM-5
ships no embedding in its nextn layer), one full ``GlmMoeDsaDecoderLayer`` (MoE + shared expert, MLA with
its own indexer), ``shared_head.norm``, and the backbone's ``lm_head`` (GLM-5 ships no ``shared_head.head``).
Plain RMSNorms (``x * w``). It is trained next to the backbone to predict token t+2.

Training differs from the Qwen variants in two GLM points: the routers are balanced the auxiliary-loss-free
way (after each step every router's ``e_score_correction_bias`` moves by ``--bias-rate`` against the sign
of its experts' load imbalance, as DeepSeek-V3 does), and the indexers are not trained (transformers
computes them under ``no_grad``; they stay at their initialisation, ``k_norm`` drawn around 1 / 0 so that
its weight and bias are not trivial tensors). A run can stop after ``--chunk-seconds`` and continue from
``OUT/resume.pt`` when started again with the same arguments (exit status 3 until it is done).

export writes the raw Hugging Face release layout: flat ``model.*`` keys, every expert one by one
(``mlp.experts.{e}.{gate,up,down}_proj.weight``), ``mlp.gate.e_score_correction_bias`` in F32 and every other
tensor in bf16, the nextn layer at ``model.layers.{num_hidden_layers}.*`` (``enorm``, ``hnorm``, ``eh_proj``,
``shared_head.norm`` and the whole decoder block, indexer included; no ``embed_tokens``, no
``shared_head.head``) in the last shard ``model-00002-of-00002`` and the rest in ``model-00001-of-00002``,
an index, and a config.json carrying what transformers' ``GlmMoeDsaConfig`` and mlx-lm's ``glm_moe_dsa``
``ModelArgs`` read (``num_nextn_predict_layers`` 1, ``topk_method``, ``scoring_func``, ``moe_layer_freq``,
``rope_parameters``, the ``index_*`` fields). It then measures the head's acceptance in torch on the
written folder (greedy k=1 with a bootstrap interval over prompts, teacher-forced, and two broken heads),
compares mlx-lm's float32 logits on the folder with transformers', and writes training.json and README.md.

parity re-checks a folder: dtypes, the key set (and that the backbone's is what ``save_pretrained``
writes), ``GlmMoeDsaForCausalLM.from_pretrained`` against this package's model, mlx-lm against
transformers; ``--acceptance`` measures the head again. mlx-vlm runs the folder's head as mlx-vlm 0.7.10's
``glm_moe_dsa_mtp`` drafter (root-folder route) and measures its greedy acceptance; run it with the
interpreter of a venv holding mlx-vlm (it needs no torch).

    python -m tools.fixture_training prepare --stage /tmp/stage
    python -m tools.fixture_training.glm train --stage /tmp/stage --out /tmp/run-glm5 --steps 3000
    python -m tools.fixture_training.glm export --stage /tmp/stage --run /tmp/run-glm5
    python -m tools.fixture_training.glm parity mtpconvert/fixture/data/text-glm5-mtp --stage /tmp/stage
    VENV/bin/python -m tools.fixture_training.glm mlx-vlm mtpconvert/fixture/data/text-glm5-mtp --stage /tmp/stage

(``python -m tools.fixture_training train|export --variant glm5 ...`` and ``parity FOLDER`` reach the same code.)
Modules: model (config, model, names and layout), train, acceptance (torch), export (export, parity, mlx-lm
against transformers), vlm_drafter (the mlx-vlm check), __main__ (this command line).
"""
