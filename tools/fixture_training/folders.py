"""What the exports and parity checks of every variant share: checkpoints in, fixture folders out (shards,
index, tokenizer files, training.json's provenance, the README's "How it was made"), and the published
per-expert names of fused experts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]


def load_checkpoint(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def checkpoint_step(name: str) -> int:
    """The step of a checkpoint file, step-NNNNNN.safetensors."""
    return int(name.split("-")[1].split(".")[0])


def provenance(script: str, commands, manifest: dict, log: dict, ckpt: str) -> dict:
    """training.json's opening keys: what made the fixture, from which corpus, tokenizer, run and checkpoint."""
    return {
        "script": script,
        "commands": commands or [],
        "corpus": {"source": "CPython standard library, pure-Python modules (stdlib path of the interpreter)",
                   "licence": manifest["licence"], "python": manifest["python"],
                   "train_files": manifest["train_files"], "heldout_files": manifest["heldout_files"],
                   "train_tokens": manifest["train_tokens"], "heldout_tokens": manifest["heldout_tokens"]},
        "tokenizer": {"kind": "byte-level BPE (tokenizers)", "vocab_size": manifest["vocab_size"],
                      "sha256": manifest["tokenizer_sha256"]},
        "training": {k: log[k] for k in ("variant", "device", "gpu", "torch", "transformers", "params", "steps",
                                         "tokens_seen", "wall_s", "args")},
        "checkpoint": {"file": ckpt, "step": checkpoint_step(ckpt)},
    }


def logged_at(log: dict, step: int):
    """The run's log line of ``step``, or None where it wrote none."""
    return next((h for h in reversed(log["history"]) if h["step"] == step), None)


def write_tokenizer_and_generation(out: Path, stage: Path) -> None:
    """A fixture folder's generation_config.json (greedy, <|im_end|> ends) and the stage's tokenizer files."""
    (out / "generation_config.json").write_text(json.dumps({"do_sample": False, "eos_token_id": 2}, indent=2) + "\n")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (out / f).write_bytes((stage / f).read_bytes())


def write_shards(out: Path, state: dict, weight_map: dict, shards) -> int:
    """OUT's model*.safetensors* replaced by ``state`` split as ``weight_map`` says (key -> one of ``shards``),
    and its index; returns the tensors' bytes."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("model*.safetensors*"):
        old.unlink()
    for shard in shards:
        save_file({k: state[k] for k, s in weight_map.items() if s == shard}, str(out / shard),
                  metadata={"format": "pt"})
    total = sum(v.numel() * v.element_size() for v in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total


def readme_method(record: dict, script_note: str, command: str, hidden_args=("device",)) -> str:
    """A fixture README's "How it was made" section: ``script_note`` names the script, then the commands run, the
    ``train`` run's options as ``command train ...`` (without ``hidden_args``) and where it ran."""
    tr = record["training"]
    opts = " ".join(f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                    for k, v in tr["args"].items() if v is not None and k not in hidden_args)
    where = f"{tr['gpu']} (torch {tr['torch']}, transformers {tr['transformers']})" if tr["gpu"] else \
        f"the CPU (torch {tr['torch']}, transformers {tr['transformers']})"
    commands = "\n".join(record["commands"])
    return f"""## How it was made

Script: {script_note}. Commands, as run:

```
{commands}
```

Arguments of the `train` run exactly as parsed (`training.args` in training.json; `--out` was the
run folder where it ran):

```
{command} train {opts}
```

{tr['steps']} steps, {tr['tokens_seen']} tokens seen, {tr['wall_s']} s on {where};
exported checkpoint `{record['checkpoint']['file']}`. The loss history and held-out losses are in
training.json.
"""


def parity_ids(args, vocab_size: int):
    """(the stage's held-out ids or None, the first --tokens of them, or --tokens random ids without a stage)."""
    held = np.load(Path(args.stage) / "heldout.npy") if args.stage else None
    ids = held[: args.tokens] if held is not None else np.random.default_rng(0).integers(3, vocab_size, args.tokens)
    return held, ids


def loading_problems(info: dict, head_prefix: str):
    """from_pretrained's loading info: (missing, mismatched, unexpected keys but the head's, under ``head_prefix``)."""
    missing = info.get("missing_keys") or []
    mismatched = info.get("mismatched_keys") or []
    unexpected = [k for k in info.get("unexpected_keys") or [] if not k.startswith(head_prefix)]
    return missing, mismatched, unexpected


# ---------------------------------------------------------------------------------------------
# names: transformers (fused experts) <-> the published raw layout (per expert)
# ---------------------------------------------------------------------------------------------
_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")

_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def split_experts(state: dict) -> dict:
    """transformers' names (``model.*``, ``lm_head``, the head's ``mtp.*``) -> published: fused experts split one by
    one, every other tensor as is."""
    out = {}
    for k, v in state.items():
        m = _FUSED.match(k)
        if not m:
            if not k.startswith(("model.", "lm_head.", "mtp.")):
                raise ValueError(f"unexpected tensor {k}")
            out[k] = v
        elif m.group(2) == "gate_up_proj":  # [E, 2I, H]: gate rows, then up rows
            inter = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{m.group(1)}.{e}.gate_proj.weight"] = v[e, :inter].contiguous()
                out[f"{m.group(1)}.{e}.up_proj.weight"] = v[e, inter:].contiguous()
        else:  # [E, H, I]
            for e in range(v.shape[0]):
                out[f"{m.group(1)}.{e}.down_proj.weight"] = v[e].contiguous()
    return out


def fuse_experts(raw: dict) -> dict:
    """The inverse of split_experts."""
    import torch

    out, experts = {}, {}
    for k, v in raw.items():
        m = _PER_EXPERT.match(k)
        if m:
            experts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = v
        else:
            out[k] = v
    for pre, d in experts.items():
        n = 1 + max(e for e, _ in d)
        out[f"{pre}.gate_up_proj"] = torch.stack([torch.cat([d[(e, "gate")], d[(e, "up")]]) for e in range(n)])
        out[f"{pre}.down_proj"] = torch.stack([d[(e, "down")] for e in range(n)])
    return out


def load_folder(folder: Path) -> dict:
    from safetensors.torch import load_file

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        out.update(load_file(str(folder / shard)))
    assert set(out) == set(index["weight_map"]), "index and shards disagree"
    return out


def load_into(lm, head, fused: dict) -> None:
    lm.load_state_dict({k: v.float() for k, v in fused.items() if not k.startswith("mtp.")}, strict=True)
    head.load_state_dict({k[4:]: v.float() for k, v in fused.items() if k.startswith("mtp.")}, strict=True)
