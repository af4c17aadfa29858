"""The floors the smokes gate on: plain numbers, importable without the runtime stack (the commit gate and
``verify.contract`` read them on every conversion, smoke or not)."""

# Greedy draft acceptance of the decoding smoke, chosen on the text fixtures with its default prompts
# (docs/runtime.md): every correct conversion, down to a 2-bit head over a 4-bit backbone, accepted >= 46.9%
# of greedy drafts; every broken one < 39% (head norms without +1 0%, fc halves swapped 2.9%, MoE experts
# reversed 35-39%). Real releases accept ~75-85%.
DECODING_MIN_ACCEPTANCE = 0.40

# Teacher-forced acceptance on the prompt text is not decoding acceptance: correct text-fixture heads score
# 39-40% on the layerwise check's default prompts (docs/runtime.md), so it keeps its own floor.
LAYERWISE_MIN_ACCEPTANCE = 0.30

# The head's MLP gain (``mlp_gain``), chosen on the text fixtures (docs/runtime.md, "The smoke floor"):
# correct heads of every precision gain +3.8 to +19.6 points on the decoding smoke's positions and +4.9 to
# +13.3 on the layerwise check's; the MoE head with its experts alone reversed +1.6 (float) / +3.3 (4-bit
# backbone) on the decoding smoke's. With ~200-300 positions one gain's 95% interval is +-5 points, so the
# margins are thin: real heads, whose MLP carries more, are expected to gain far more than these small ones.
MIN_MLP_GAIN = 0.035
