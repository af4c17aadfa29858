"""The stage every text fixture trains on: the corpus, its tokenizer and token ids (``prepare``).

Corpus: pure-Python modules of the standard library present in CPython 3.10, 3.11 and 3.12 under
the same path (modules removed in 3.12, added after 3.10, or turned into packages are left out),
and in the stdlib package of Debian/Ubuntu builds (no test/, idlelib, tkinter, lib2to3, distutils,
venv). Their text differs a little between versions: the manifest records the SHA-256 of every file
that was read. Licence: PSF License Agreement (the interpreter's).
"""

from __future__ import annotations

import hashlib
import json
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

_TOP = """
__future__ _aix_support _bootsubprocess _collections_abc _compat_pickle _compression _markupbase
_osx_support _py_abc _pydecimal _pyio _sitebuiltins _strptime _threading_local _weakrefset abc aifc
argparse ast base64 bdb bisect bz2 cProfile cgi cgitb chunk code codecs codeop colorsys compileall
configparser contextlib contextvars copy copyreg crypt csv dataclasses datetime decimal dis doctest
enum filecmp fnmatch ftplib functools genericpath getopt getpass gettext glob gzip hashlib hmac
imaplib imghdr inspect io ipaddress keyword linecache locale lzma mailbox mailcap mimetypes
modulefinder nntplib ntpath nturl2path numbers opcode operator optparse os pathlib pdb pickle
pickletools pipes pkgutil platform plistlib poplib posixpath profile pstats pty py_compile pyclbr
pydoc queue quopri random reprlib rlcompleter runpy secrets selectors shelve shutil signal site
smtplib sndhdr socket socketserver ssl stat statistics string stringprep struct subprocess sunau
symtable sysconfig tabnanny tarfile telnetlib tempfile threading timeit token tokenize trace
traceback tracemalloc tty turtle types typing uu uuid warnings wave weakref webbrowser xdrlib
zipapp zipimport
"""

_PACKAGES = {
    "asyncio": "__init__ __main__ base_events base_futures base_subprocess base_tasks constants coroutines events "
               "exceptions format_helpers futures locks log mixins proactor_events protocols queues runners "
               "selector_events sslproto staggered streams subprocess tasks threads transports trsock unix_events "
               "windows_events windows_utils",
    "collections": "__init__ abc",
    "concurrent/futures": "__init__ _base process thread",
    "email": "__init__ _encoded_words _header_value_parser _parseaddr _policybase base64mime charset contentmanager "
             "encoders errors feedparser generator header headerregistry iterators message parser policy "
             "quoprimime utils",
    "email/mime": "__init__ application audio base image message multipart nonmultipart text",
    "json": "__init__ decoder encoder scanner tool",
    "http": "__init__ client cookiejar cookies server",
    "urllib": "__init__ error parse request response robotparser",
    "logging": "__init__ config handlers",
    "xml/dom": "NodeFilter __init__ domreg expatbuilder minicompat minidom pulldom xmlbuilder",
    "xml/etree": "ElementInclude ElementPath ElementTree __init__ cElementTree",
    "xml/sax": "__init__ _exceptions expatreader handler saxutils xmlreader",
    "multiprocessing": "__init__ connection context forkserver heap managers pool popen_fork popen_forkserver "
                       "popen_spawn_posix popen_spawn_win32 process queues reduction resource_sharer "
                       "resource_tracker shared_memory sharedctypes spawn synchronize util",
    "unittest": "__init__ __main__ _log async_case case loader main mock result runner signals suite util",
    "wsgiref": "__init__ handlers headers simple_server util validate",
    "dbm": "__init__ dumb gnu ndbm",
    "html": "__init__ entities parser",
    "xmlrpc": "__init__ client server",
    "sqlite3": "__init__ dbapi2 dump",
    "ctypes": "__init__ _aix _endian util wintypes",
    "curses": "__init__ ascii has_key panel textpad",
    "pydoc_data": "__init__ topics",  # the language reference's topics: prose, as pydoc shows it
}

TRAIN_FILES = tuple([f"{m}.py" for m in _TOP.split()]
                    + [f"{pkg}/{m}.py" for pkg, mods in _PACKAGES.items() for m in mods.split()])
# Held out of training: the prompts of benchmarks/fixture_acceptance.py and the validation loss.
HELDOUT_FILES = tuple(f"{m}.py" for m in "calendar cmd difflib fileinput fractions graphlib heapq netrc pprint "
                      "sched shlex textwrap".split())

LICENCE = "PSF License Agreement (Python Software Foundation License), the licence of CPython's standard library"

VOCAB = 2048  # the tokenizer's vocabulary: every variant's vocab_size
EOS_ID, PAD_ID = 2, 0  # <|im_end|> and <|endoftext|>: the specials' ids (mtpconvert.fixture.language.SPECIALS)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def read_files(names, root: Path | None = None):
    """[(name, text, sha256 of the bytes)] in the order given; fails on a missing file."""
    root = root or stdlib_root()
    out = []
    for name in names:
        data = (root / name).read_bytes()
        out.append((name, data.decode("utf-8").replace("\r\n", "\n"), hashlib.sha256(data).hexdigest()))
    return out


def build_text_tokenizer(texts, vocab_size: int):
    """A Qwen-style byte-level BPE (same pre-tokenizer and specials as the Markov fixture's)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    from mtpconvert.fixture.language import PRETOKENIZE_REGEX, SPECIALS

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok, SPECIALS


TOKENIZER_CONFIG = {
    "tokenizer_class": "Qwen2Tokenizer",
    "bos_token": None,
    "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>",
    "unk_token": None,
    "model_max_length": 4096,
    "add_prefix_space": False,
    "clean_up_tokenization_spaces": False,
}


def prepare(args) -> None:
    stage = Path(args.stage)
    stage.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    train = read_files(TRAIN_FILES)
    held = read_files(HELDOUT_FILES)
    tok, specials = build_text_tokenizer([t for _, t, _ in train], args.vocab)
    tok.save(str(stage / "tokenizer.json"))
    (stage / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2) + "\n")
    eot = tok.token_to_id(specials[0])

    def ids(files):
        out = []
        for _, text, _ in files:
            out.extend(tok.encode(text).ids)
            out.append(eot)  # documents separated by <|endoftext|>
        return np.array(out, dtype=np.uint16)

    train_ids, held_ids = ids(train), ids(held)
    np.save(stage / "train.npy", train_ids)
    np.save(stage / "heldout.npy", held_ids)
    manifest = {
        "python": sys.version.split()[0],
        "stdlib": str(stdlib_root()),
        "licence": LICENCE,
        "vocab_size": tok.get_vocab_size(),
        "train_files": [{"path": n, "sha256": h, "chars": len(t)} for n, t, h in train],
        "heldout_files": [{"path": n, "sha256": h, "chars": len(t)} for n, t, h in held],
        "train_tokens": int(train_ids.size),
        "heldout_tokens": int(held_ids.size),
        "train_chars": sum(len(t) for _, t, _ in train),
        "tokenizer_sha256": hashlib.sha256((stage / "tokenizer.json").read_bytes()).hexdigest(),
    }
    (stage / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"{len(train)} train files, {manifest['train_chars'] / 1e6:.2f} M chars -> "
          f"{train_ids.size / 1e6:.2f} M tokens "
          f"({manifest['train_chars'] / train_ids.size:.2f} chars/token); held out {held_ids.size} tokens; "
          f"{time.time() - t0:.1f} s")
