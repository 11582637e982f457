"""A tiny random-weight llama GGUF, built locally, so the worker, the tests and the benchmarks run real
llama.cpp inference without downloading a model. Its output is gibberish by design."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import gguf
import numpy as np
import numpy.typing as npt

#: Bumped whenever the builder's output changes, so a cached file from an older builder is not reused.
_BUILDER_VERSION = 1

_CONTEXT_LENGTH = 8192

# Roles are written as plain text (not special tokens) so the template needs no extra vocab entries.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

_WORDS = """
the of and to in is was for that with on as by at from it he she they we you his her their our
your this these those be are were been has have had do does did not but or if then than so can
could would should will may might must shall one two three four five six seven eight nine ten
first last new old good great small large long little big high low same other more most some
any all each every many much such only just also very still even well back up down out over
under about after before between through during without again here there when where why how
what which who whom whose time year day week month people man woman child world life hand part
place case point work way thing state system program number group problem fact water word home
room mother father house name city night story book line end money music power game question
school area company country family friend eye head face side team idea body information
stream broker token model worker request answer server client event message reply resume
make take give get go come see know think look want use find tell ask seem feel try leave call
keep let begin show hear play run move live believe bring happen write provide sit stand lose
pay meet include continue set learn change lead understand watch follow stop create speak read
allow add spend grow open walk win offer remember love consider appear buy wait serve die send
expect build stay fall cut reach kill remain say said made went came took gave found thought
because while since until though although however therefore into onto upon within along across
""".split()

_PIECES = """
s es ed ing er ers est ly tion tions ment ness able ible al ial ful less ous ive ize ise ity
re un in im dis pre pro con com ex en em de th he an at on or ar st nd nt ou ea te ti to it
is as ha hi ve le se me ne ri ro ra la li ma co ca ce ch sh qu ck ll ss ee oo
""".split()

# Common characters, so Chinese text mostly maps to real pieces; the rest falls back to byte tokens.
_CHINESE = (
    "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可里"
    "后小么心多天而能好都然没日于起还发成事只作当想看文无开手十用主行方又如前所本见经头面公同三已老从"
    "动两长知民样现分将外但身些与高意进把法此实回二理美点月明其种声全工己话儿者向情部正名定女问力机给"
    "等几很业最间新什打便位因重被走电四第门相次东政海口使教西再平真听世气信北少关并内加化由却代军产入"
    "先山五太水万市眼体别处总才场师书比住员九笑性通目华报立马命张活难神数件安表原车白应路期叫死常提感"
    "金何更反合放做系计或司利受光王果亲界及今京务制解各任至清物台象记边共风战干接它许八特觉望直服毛林"
    "题建南度统色字请交爱让认算论百吃义科怎元社术结六功指思非流每青管夫连远资队跟带花快条院变联言权往"
    "展该领传近留红治决周保达办运武半候七必城父强步完革深区即求品士转量空甚众技轻程告江语英基派满式李"
    "你好谢再见"
)


def demo_model_name(embd: int = 64, layers: int = 2) -> str:
    """The ``general.name`` of a demo model: it says plainly that the weights are random."""
    return f"rsb-demo-random-{embd}x{layers}"


DEMO_MODEL_NAME = demo_model_name()


def _vocab() -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    # Without the byte tokens llama.cpp aborts the whole process on a character it cannot map.
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    scores = [0.0] * len(tokens)

    normal: dict[str, None] = {}  # insertion-ordered set, so the vocab is deterministic
    for c in range(0x21, 0x7F):
        normal[chr(c)] = None
    normal["\u2581"] = None
    for ch in _CHINESE:
        normal[ch] = None
    pieces = [*_PIECES, *("\u2581" + w for w in _WORDS), *("\u2581" + w.capitalize() for w in _WORDS[:40])]
    for piece in pieces:
        # SPM only reaches a piece by merging pieces already in the vocab; every prefix being present
        # guarantees a merge path exists.
        for end in range(1, len(piece) + 1):
            normal[piece[:end]] = None
    for piece in normal:
        tokens.append(piece)
        types.append(gguf.TokenType.NORMAL)
        # SPM merges the highest-scoring bigram first: longer pieces must win.
        scores.append(float(len(piece)))
    return tokens, scores, [int(t) for t in types]


def build_demo_model(path: str | Path, *, embd: int = 64, layers: int = 2, seed: int = 0) -> Path:
    """Write a random-weight llama GGUF of ``embd`` width and ``layers`` blocks to ``path`` (overwritten).
    The same arguments always give the same file."""
    if embd % 16 or embd <= 0 or layers <= 0:
        raise ValueError("embd must be a positive multiple of 16 and layers positive")
    path = Path(path)
    rng = np.random.default_rng(seed)
    tokens, scores, types = _vocab()
    n_vocab = len(tokens)
    n_head = embd // 16
    n_ff = 4 * embd

    w = gguf.GGUFWriter(path, "llama")
    w.add_name(demo_model_name(embd, layers))
    w.add_description("Random weights for testing rsb; the output is meaningless.")
    w.add_context_length(_CONTEXT_LENGTH)
    w.add_embedding_length(embd)
    w.add_block_count(layers)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_rope_dimension_count(embd // n_head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    def mat(rows: int, cols: int) -> npt.NDArray[np.float32]:
        # Scaled so activations and logits stay O(1): the token distribution is broad, not degenerate.
        m: npt.NDArray[np.float32] = (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
        return m

    ones = np.ones(embd, dtype=np.float32)
    # numpy shapes are ggml's reversed: (out_features, in_features).
    w.add_tensor("token_embd.weight", rng.standard_normal((n_vocab, embd)).astype(np.float32))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.attn_q.weight", mat(embd, embd))
        w.add_tensor(f"blk.{i}.attn_k.weight", mat(embd, embd))
        w.add_tensor(f"blk.{i}.attn_v.weight", mat(embd, embd))
        w.add_tensor(f"blk.{i}.attn_output.weight", mat(embd, embd))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.ffn_gate.weight", mat(n_ff, embd))
        w.add_tensor(f"blk.{i}.ffn_up.weight", mat(n_ff, embd))
        w.add_tensor(f"blk.{i}.ffn_down.weight", mat(embd, n_ff))
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("output.weight", mat(n_vocab, embd))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def default_cache_dir() -> Path:
    """``$RSB_CACHE_DIR``, else ``$XDG_CACHE_HOME/rsb``, else ``~/.cache/rsb``."""
    explicit = os.environ.get("RSB_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "rsb"


def default_demo_model_path() -> Path:
    return default_cache_dir() / f"{DEMO_MODEL_NAME}-v{_BUILDER_VERSION}.gguf"


def ensure_demo_model(path: str | Path | None = None) -> Path:
    """Return the demo model's path, building it first if it is not there yet. Safe against concurrent
    callers: each builds into its own temporary file and renames it into place, so a reader never sees a
    half-written model (the build is deterministic, so the last rename wins harmlessly)."""
    target = Path(path) if path is not None else default_demo_model_path()
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        build_demo_model(tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target
