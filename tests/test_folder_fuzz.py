"""Property test over converted folders: random damage to the head files, links, config fields and the
manifest, and every command that opens a folder tried on the result.

For each seeded case a converted folder (float or 4-bit, sidecar layout) gets one or two damages, then
``verify``, ``smoke``, ``convert`` (the folder as source) and ``add-mtp`` (onto the folder) run in-process,
each under a time limit. Every command either exits 0 or exits non-zero with a message naming the
damaged file; ``verify`` always refuses a damaged folder, and each damage lists the other commands that
must refuse it (those that read what it damaged). No command changes the folder it read (a refused
add-mtp leaves its target as it was), writes anywhere but its output and the output's lock/partial beside
it, or touches the files links point to. An untouched folder passes verify, smoke and convert.

The smoke's MLP-gain statistic is stubbed and it decodes two tokens of one prompt: what is under test
is how each command opens the folder, not the head's quality (tests/test_smoke.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import struct
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mtpconvert.cli import app
from mtpconvert.fixture import DENSE

CASES = int(os.environ.get("MTPCONVERT_FOLDER_FUZZ_CASES", "48"))
SEED = int(os.environ.get("MTPCONVERT_FOLDER_FUZZ_SEED", "28"))
LIMIT_S = 20  # per command: a FIFO opened for reading would block forever

S, L, M, C = "mtp.safetensors", "mtp/weights.safetensors", "mtp/manifest.json", "config.json"
SHARD = "model-00001-of-00001.safetensors"
ALL = {"verify", "smoke", "convert", "add-mtp"}
runner = CliRunner()


# ------------------------------------------------------------------------- the tree, read without opening specials


def digest(root: Path) -> dict:
    """Every entry under ``root`` (links not followed): a file's sha256, a link's target, a FIFO or folder
    as such. Never opens anything but regular files."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in sorted(dirs + files):
            p = Path(dirpath) / name
            st = os.lstat(p)
            rel = p.relative_to(root).as_posix()
            if os.path.islink(p):
                out[rel] = "link:" + os.readlink(p)
            elif os.path.isfile(p):
                out[rel] = f"{st.st_ino}:" + hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                out[rel] = "dir" if os.path.isdir(p) else f"special:{st.st_mode:o}"
    return out


# ------------------------------------------------------------------------- damage


def _header(blob: bytes):
    n = struct.unpack("<Q", blob[:8])[0]
    return n, json.loads(blob[8: 8 + n])


def _write(folder: Path, rel: str, data: bytes, in_place: bool) -> None:
    """In place keeps the inode (a hard-linked twin changes too); otherwise the name gets a new file."""
    p = folder / rel
    if in_place and p.is_file():
        with open(p, "r+b") as f:
            f.truncate(0)
            f.write(data)
    else:
        p.unlink()
        p.write_bytes(data)


def _replace(folder: Path, rel: str) -> Path:
    p = folder / rel
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    elif os.path.lexists(p):
        p.unlink()
    return p


def bytes_damage(rng, folder, outside):
    intact = [r for r in (S, L) if (folder / r).is_file() and not (folder / r).is_symlink()]
    if not intact:
        return link_damage(rng, folder, outside)
    rel = rng.choice(intact)
    blob = (folder / rel).read_bytes()
    kind = rng.choice(["truncate", "absurd", "past-end", "not-json", "not-object", "other-bytes", "offsets"])
    try:
        n, header = _header(blob)
        assert isinstance(header, dict)
    except (ValueError, AssertionError, struct.error):  # damaged already
        kind = "truncate"
    if kind == "truncate":
        data = blob[: rng.randrange(0, max(1, len(blob)))]
    elif kind == "absurd":
        data = struct.pack("<Q", rng.choice([2**40, 2**62, 2**64 - 1])) + blob[8:]
    elif kind == "past-end":
        data = struct.pack("<Q", len(blob)) + blob[8:]
    elif kind == "not-json":
        i = rng.randrange(8, 8 + n)
        data = blob[:i] + bytes([rng.choice(b"\xff{}[]\",:")]) + blob[i + 1:]
        try:  # still JSON (a renamed key): make it not
            _header(data)
            data = blob[:8] + b"\xff" + blob[9:]
        except ValueError:
            pass
    elif kind == "not-object":
        body = json.dumps([1, 2]).encode().ljust(n)
        data = blob[:8] + body + blob[8 + n:]
    elif kind == "offsets":
        key = rng.choice(sorted(k for k in header if k != "__metadata__"))
        header[key]["data_offsets"] = [0, len(blob) * 2]
        raw = json.dumps(header).encode()
        data = struct.pack("<Q", len(raw)) + raw + blob[8 + n:]
    else:  # valid safetensors, one tensor's bytes zeroed: a different head under the other name
        key = rng.choice(sorted(k for k in header if k != "__metadata__"))
        a, b = header[key]["data_offsets"]
        data = blob[: 8 + n + a] + bytes(b - a) + blob[8 + n + b:]
        _write(folder, rel, data, in_place=False)
        return {S, L}, ALL, f"{kind} {rel}"
    in_place = rng.random() < 0.5
    twins = in_place and (folder / S).samefile(folder / L)  # one inode: both names hold the damage
    _write(folder, rel, data, in_place)
    return ({S, L} if twins else {rel}), ALL, f"{kind} {rel}{' in place' if in_place else ''}"


def link_damage(rng, folder, outside):
    rel = rng.choice([S, L, S, L, SHARD, C])
    kind = rng.choice(["outside", "outside-dangling", "dangling", "not-safetensors", "fifo", "directory"])
    if kind == "not-safetensors" and rel == C:
        kind = "fifo"
    target = outside / f"copy-{rng.randrange(1000)}"
    if kind == "outside":
        regular = (folder / rel).is_file() and not (folder / rel).is_symlink()
        shutil.copy(folder / rel if regular else outside / "keep.txt", target)  # a valid file, not this folder's
    p = _replace(folder, rel)
    if kind in ("outside", "outside-dangling"):
        p.symlink_to(target)
    elif kind == "dangling":
        p.symlink_to("nothing-here.safetensors")
    elif kind == "not-safetensors":
        p.symlink_to(os.path.relpath(folder / rng.choice(["tokenizer.json", "config.json"]), p.parent))
    elif kind == "fifo":
        os.mkfifo(p)
    else:
        p.mkdir()
    return {rel}, ALL, f"{kind} at {rel}"


def _edit_config(folder, fn):
    p = folder / C
    cfg = json.loads(p.read_text())
    fn(cfg)
    p.unlink()  # a new file: the base folder's inode stays as it was
    p.write_text(json.dumps(cfg))


def mtp_file_damage(rng, folder, outside):
    value = rng.choice(["nope.safetensors", "../mtp.safetensors", "/etc/passwd", 5, "", None, "config.json",
                        "tokenizer.json", SHARD, "mtp", "mtp/manifest.json", "mtp/../mtp.safetensors", ["x"]])
    def edit(cfg):
        cfg["mlx_lm_extra_tensors"]["mtp_file"] = value
    if rng.random() < 0.15:
        def edit(cfg):  # noqa: F811
            cfg["mlx_lm_extra_tensors"] = rng.choice(["mtp.safetensors", [], 3])
    _edit_config(folder, edit)
    harmless = value is None and isinstance(json.loads((folder / C).read_text())["mlx_lm_extra_tensors"], dict)
    return {C}, set() if harmless else ALL, f"mtp_file {value!r}"  # null: the default name, as mtplx reads it


def tensor_count_damage(rng, folder, outside):
    value = rng.choice([0, 1, -1, 14, 16, 10**9, "15", 15.0, None, True])
    def edit(cfg):
        if isinstance(cfg["mlx_lm_extra_tensors"], dict):  # else broken already
            cfg["mlx_lm_extra_tensors"]["mtp_tensor_count"] = value
    _edit_config(folder, edit)
    return {C}, ALL, f"mtp_tensor_count {value!r}"


def layers_damage(rng, folder, outside):
    value = rng.choice([0, 2, 3, -1, "1", 1.5, None, True, [1]])
    _edit_config(folder, lambda cfg: cfg["text_config"].update(mtp_num_hidden_layers=value))
    return {C}, {"verify", "smoke"}, f"mtp_num_hidden_layers {value!r}"


def quantization_damage(rng, folder, outside):
    def edit(cfg):
        q = cfg.get("quantization")
        choice = rng.choice(["bits", "group", "mode", "drop", "add", "head-entry", "not-a-dict"])
        if choice == "drop" and q:
            cfg.pop("quantization")
            cfg.pop("quantization_config", None)
        elif choice == "not-a-dict":
            cfg["quantization"] = rng.choice(["4bit", 4, []])
        elif choice == "head-entry":
            cfg.setdefault("quantization", {"bits": 4, "group_size": 32})["mtp.fc"] = {"bits": 4, "group_size": 32}
        elif q and choice in ("bits", "group", "mode"):
            field, value = {"bits": ("bits", 8 if q["bits"] != 8 else 4), "group": ("group_size", 128),
                            "mode": ("mode", "mxfp4")}[choice]
            q[field] = value
            if "quantization_config" in cfg:
                cfg["quantization_config"][field] = value
        else:  # over float weights: mlx-lm quantizes only modules with scales, so nothing changes
            cfg["quantization"] = {"bits": 4, "group_size": 64}
            choice = "harmless"
        done.append(choice)
    done = []
    _edit_config(folder, edit)
    return {C}, set() if done == ["harmless"] else {"verify"}, f"quantization {done[0]}"


def manifest_damage(rng, folder, outside):
    kind = rng.choice(["not-json", "array", "zero-centred", "format-number", "fifo", "outside", "dangling",
                       "directory"])
    p = folder / M
    if kind in ("fifo", "outside", "dangling", "directory"):
        target = outside / f"manifest-{rng.randrange(1000)}.json"
        if kind == "outside":
            target.write_text(json.dumps({"artifact_schema_version": 1, "rmsnorm_weight_format": "mlx_gamma"}))
        _replace(folder, M)
        {"fifo": lambda: os.mkfifo(p), "directory": p.mkdir,
         "outside": lambda: p.symlink_to(target), "dangling": lambda: p.symlink_to("gone.json")}[kind]()
    else:
        body = {"not-json": "{nope", "array": "[1]",
                "zero-centred": json.dumps({"artifact_schema_version": 1, "rmsnorm_weight_format": "hf_zero_centered"}),
                "format-number": json.dumps({"artifact_schema_version": 1, "rmsnorm_weight_format": 1})}[kind]
        _replace(folder, M)
        p.write_text(body)
    return {M}, {"verify"}, f"manifest {kind}"


ORDER = [mtp_file_damage, tensor_count_damage, layers_damage, quantization_damage, manifest_damage, bytes_damage,
         link_damage]
DAMAGES = [bytes_damage, bytes_damage, link_damage, link_damage, link_damage, mtp_file_damage, tensor_count_damage,
           layers_damage, quantization_damage, manifest_damage, manifest_damage]


# ------------------------------------------------------------------------- commands


class Hung(BaseException):
    pass


def invoke(args):
    """The CLI in-process under a time limit (SIGALRM interrupts a blocking open); (exit code, output, seconds)."""
    fired = []

    def alarm(signum, frame):
        fired.append(True)
        raise Hung(f"{args[0]} ran past {LIMIT_S} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, LIMIT_S)
    t0 = time.perf_counter()
    try:
        result = runner.invoke(app, args, env={"COLUMNS": "400"})
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert not fired, f"{args[0]} hung: {args}"
    return result.exit_code, result.output, time.perf_counter() - t0


def commands(folder: Path, work: Path):
    return {
        "verify": ["verify", str(folder)],
        "smoke": ["smoke", str(folder), "--max-tokens", "2", "-p", "a", "--min-acceptance", "0"],
        "convert": ["convert", str(folder), str(work / "conv" / "out"), "--no-smoke"],
        "add-mtp": ["add-mtp", str(DENSE), str(folder), "--no-smoke"],
    }


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("bases")
    out = {}
    for name, extra in [("float", []), ("q4", ["--bits", "4", "--group-size", "32"])]:
        code, output, _ = invoke(["convert", str(DENSE), str(root / name), "--no-smoke", *extra])
        assert code == 0, output
        out[name] = root / name
    return out


@pytest.fixture(autouse=True)
def quick_smoke(monkeypatch):
    import mtpconvert.runtime.smoke.decode as smoke_mod

    monkeypatch.setattr(smoke_mod, "teacher_forced_mlp_gain", lambda *a, **k: None)


def copy_folder(base: Path, dst: Path) -> Path:
    shutil.copytree(base, dst)
    (dst / L).unlink()
    os.link(dst / S, dst / L)  # as convert writes it: one inode, two names
    return dst


def refusals(base: str) -> dict:
    """What a command says of the untouched folder when it cannot take it at all: add-mtp onto a folder
    that has a head, convert from a quantized one."""
    return {"add-mtp": "already has MTP tensors", **({"convert": "already quantized"} if base == "q4" else {})}


def test_untouched_folders_pass_every_command(bases, tmp_path):
    for name, base in bases.items():
        work = tmp_path / name
        folder = copy_folder(base, work / "src")
        before = digest(folder)
        for command, args in commands(folder, work).items():
            code, output, _ = invoke(args)
            if command in refusals(name):
                assert code != 0 and refusals(name)[command] in output, output
            else:
                assert code == 0, (command, output)
            assert digest(folder) == before, command
        shutil.rmtree(work / "conv", ignore_errors=True)


def check_command(command, args, base, folder, work, outside, victims, must, label) -> float:
    src_before, outside_before = digest(folder), digest(outside)
    code, output, seconds = invoke(args)
    said = f"{label} | {command} exit {code}:\n{output}"
    assert "internal error" not in output and "Traceback" not in output, said
    named = any(v in output for v in victims) or refusals(base).get(command, "\0") in output
    if code != 0:
        assert named, f"the message names none of {sorted(victims)}: {said}"
    else:
        assert command not in must, said
    assert digest(outside) == outside_before, (label, command)
    if command == "add-mtp" and code == 0:  # the head added: the folder is whole again
        code2, out2, _ = invoke(["verify", str(folder)])
        assert code2 == 0, (label, out2)
    else:
        assert digest(folder) == src_before, (label, command)
    if command == "convert":
        conv = work / "conv"
        left = set(os.listdir(conv)) if conv.exists() else set()
        assert left <= {"out", ".out.lock", ".out.partial"}, (label, left)
        if code == 0:
            code2, out2, _ = invoke(["verify", str(conv / "out")])
            assert code2 == 0, (label, out2)
        else:
            assert not (conv / "out").exists(), label
    assert set(os.listdir(work)) <= {"src", "outside", "conv", ".src.lock"}, (label, command,
                                                                             os.listdir(work))
    return seconds


def test_damaged_folders(bases, tmp_path):
    failures = []
    fixture_before = digest(DENSE)
    times = {c: 0.0 for c in ALL}
    for case in range(CASES):
        rng = random.Random(SEED * 1000 + case)
        work = tmp_path / f"case{case}"
        outside = work / "outside"
        outside.mkdir(parents=True)
        (outside / "keep.txt").write_text("not a model file")
        base = rng.choice(sorted(bases))
        folder = copy_folder(bases[base], work / "src")
        victims, must, what = set(), set(), []
        # config and manifest edits first (they read config.json), links last (they may leave a FIFO)
        for damage in sorted(rng.sample(DAMAGES, rng.choice([1, 1, 2])), key=ORDER.index):
            v, m, w = damage(rng, folder, outside)
            victims |= v
            must |= m
            what.append(w)
        label = f"case {case} ({base}): {'; '.join(what)}"
        for command, args in commands(folder, work).items():
            try:
                times[command] += check_command(command, args, base, folder, work, outside, victims, must, label)
            except AssertionError as e:
                failures.append(str(e))
        shutil.rmtree(work)
    assert not failures, "\n".join(failures)
    assert digest(DENSE) == fixture_before
    print({c: round(t, 2) for c, t in times.items()})
