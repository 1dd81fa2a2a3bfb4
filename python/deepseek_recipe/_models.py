"""Which tokenizer and prompt format a `tokenizer_model` names. No downloads, ever.

A `tokenizer_model` is one of (or a Tokenizer object, with format=):
  - a known model name (MODELS), with or without the "deepseek-ai/" prefix, any case: its prompt format comes
    from the table, and its tokenizer is the one shipped inside this package, DeepSeek-V3's: exact ids for V3
    and R1; for later models the text is exact but their newer added tokens (<think>, </think>, ...) become
    several ids, which a warning says once per name;
  - a local directory holding tokenizer.json (or the tokenizer.json file itself): the format comes from
    `format=` if given, else from the directory's tokenizer_config.json (an official chat template we know,
    byte for byte, or a `name_or_path` in MODELS) or config.json (`_name_or_path`); otherwise ValueError.
Tokenizers are loaded once per file and shared (they are immutable and thread-safe).
"""
import hashlib
import json
import os
import threading
import warnings

from . import _core

FORMATS = tuple(_core.formats())

# Hugging Face model name -> prompt format. The formats' references are listed in
# include/deepinfer/recipe/renderer.h; the goldens in tests/data/chat-templates/goldens.
MODELS = {
    "deepseek-ai/DeepSeek-V3": "deepseek-v3",
    "deepseek-ai/DeepSeek-V3-0324": "deepseek-v3",
    "deepseek-ai/DeepSeek-R1": "deepseek-r1",
    "deepseek-ai/DeepSeek-V3.1": "deepseek-v3.1",
    "deepseek-ai/DeepSeek-V3.1-Terminus": "deepseek-v3.1",
    "deepseek-ai/DeepSeek-V3.2": "deepseek-v3.2",
    "deepseek-ai/DeepSeek-V4-Flash": "deepseek-v4",
    "deepseek-ai/DeepSeek-V4-Pro": "deepseek-v4",
    "deepseek-ai/DeepSeek-V4.1-Flash": "deepseek-v4.1",
}

# SHA-256 of official chat templates (tokenizer_config.json "chat_template", or chat_template.jinja), so that
# a checkpoint directory names its own format: DeepSeek-V3's (the tokenizer_config.json shipped here), the R1
# template (DeepSeek-R1-Distill, as llama.cpp keeps it) and V3.1's (as llama.cpp keeps it).
_TEMPLATE_FORMATS = {
    "3b8267e54b67df6500f231ffa969955cc9d26b3444a291ced4eb96ca7d3ca1ea": "deepseek-v3",
    "03cb8191637dd031cf7dca8bffd267b741d0cb46ab490dc7e452f62f02184b02": "deepseek-r1",
    "7fe7159748925dc7d9e2aaeb11e4bd3121c311d8d0e3a0d6377fb8550e64c560": "deepseek-v3.1",
}

_PACKAGE_TOKENIZER = os.path.join(os.path.dirname(__file__), "tokenizers", "deepseek-v3")

# The shipped tokenizer is DeepSeek-V3's. V3 and R1 use it as is; later checkpoints ship tokenizers with more
# added tokens (<think> and </think> as single tokens from V3.1 on, V4.1's <｜System｜>, ...), which this one
# writes as ordinary pieces: the text is exact, those ids are not. Their names warn once.
_EXACT_WITH_SHIPPED_TOKENIZER = ("deepseek-v3", "deepseek-r1")

_lock = threading.Lock()
_tokenizers = {}  # realpath of tokenizer.json -> Tokenizer
_warned = set()   # model names warned about


def _model_key(name):
    name = name.strip().lower()
    return name[len("deepseek-ai/"):] if name.startswith("deepseek-ai/") else name


_MODEL_KEYS = {_model_key(name): fmt for name, fmt in MODELS.items()}


def format_for_model(name):
    """The prompt format of a known model name ("deepseek-ai/DeepSeek-V4.1-Flash" -> "deepseek-v4.1"), or None."""
    return _MODEL_KEYS.get(_model_key(name))


def _known_names():
    return ", ".join(MODELS)


def _check_format(fmt):
    if fmt not in FORMATS:
        raise ValueError("unknown prompt format %r; expected one of %s" % (fmt, ", ".join(FORMATS)))
    return fmt


def _tokenizer_file(tokenizer_model):
    """(tokenizer.json path, directory or None, known format or None) for a tokenizer_model."""
    if not isinstance(tokenizer_model, (str, os.PathLike)):
        raise TypeError("tokenizer_model must be a str or a path, got %s" % type(tokenizer_model).__name__)
    path = os.fspath(tokenizer_model)
    if os.path.isdir(path):
        file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            raise FileNotFoundError("%s holds no tokenizer.json" % path)
        return file, path, None
    if os.path.isfile(path):
        return path, os.path.dirname(path) or ".", None
    fmt = format_for_model(path)
    if fmt is not None:
        if fmt not in _EXACT_WITH_SHIPPED_TOKENIZER and _model_key(path) not in _warned:
            _warned.add(_model_key(path))
            warnings.warn("deepseek_recipe: %s is tokenized with the shipped DeepSeek-V3 tokenizer, which lacks "
                          "this model's newer added tokens (such as <think> and </think>): the prompt text is "
                          "exact but those markers become several ids; pass tokenizer_model=<the checkpoint's "
                          "directory> for its exact ids" % path, UserWarning, stacklevel=3)
        file = os.path.join(_PACKAGE_TOKENIZER, "tokenizer.json")
        if not os.path.isfile(file):
            raise FileNotFoundError("the tokenizer shipped with deepseek_recipe is missing: %s" % file)
        return file, None, fmt
    if path.startswith(("/", ".", "~")) or path.count("/") > 1:
        raise FileNotFoundError("tokenizer_model %r: no such directory" % path)
    raise ValueError("unknown model %r (and no such directory): pass a local directory holding tokenizer.json, "
                     "or one of: %s" % (path, _known_names()))


def _read_json(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


# A checkpoint's encoding/ directory (DeepSeek's own Python encoders, shipped from V3.2 on) names its format, as
# `deepinfer serve` reads it (src/server/http_server.cpp, checkpoint_chat_format).
_ENCODER_FORMATS = (("encoding_dsv41.py", "deepseek-v4.1"), ("encoding_dsv4.py", "deepseek-v4"),
                    ("encoding_dsv32.py", "deepseek-v3.2"))


def detect_format(directory):
    """The prompt format a checkpoint or tokenizer directory identifies, or None. In the order `deepinfer serve`
    uses: config.json's "chat_format" (a format name; anything else is a ValueError), DeepSeek's encoder file in
    encoding/, then an official chat template we know (tokenizer_config.json or chat_template.jinja) or a model
    name in tokenizer_config.json's name_or_path / config.json's _name_or_path."""
    model_config = _read_json(os.path.join(directory, "config.json"))
    if isinstance(model_config, dict) and "chat_format" in model_config:
        named = model_config["chat_format"]
        if not isinstance(named, str) or named not in FORMATS:
            raise ValueError("%s: config.json's chat_format must be one of %s, got %r"
                             % (directory, ", ".join(FORMATS), named))
        return named
    for file, fmt in _ENCODER_FORMATS:
        if os.path.isfile(os.path.join(directory, "encoding", file)):
            return fmt
    templates = []
    config = _read_json(os.path.join(directory, "tokenizer_config.json"))
    if isinstance(config, dict):
        if isinstance(config.get("chat_template"), str):
            templates.append(config["chat_template"])
    try:
        with open(os.path.join(directory, "chat_template.jinja"), encoding="utf-8") as f:
            templates.append(f.read())
    except OSError:
        pass
    for template in templates:
        fmt = _TEMPLATE_FORMATS.get(hashlib.sha256(template.encode("utf-8")).hexdigest())
        if fmt is not None:
            return fmt
    for source, key in ((config, "name_or_path"), (model_config, "_name_or_path")):
        if isinstance(source, dict) and isinstance(source.get(key), str):
            fmt = format_for_model(source[key].rstrip("/").split("/")[-1])
            if fmt is not None:
                return fmt
    return None


def _load(file):
    key = os.path.realpath(file)
    with _lock:
        tokenizer = _tokenizers.get(key)
        if tokenizer is None:
            tokenizer = _core.Tokenizer._load(key)
            _tokenizers[key] = tokenizer
        return tokenizer


def load_tokenizer(tokenizer_model):
    """The Tokenizer a tokenizer_model names (loaded once per file)."""
    file, _, _ = _tokenizer_file(tokenizer_model)
    return _load(file)


_resolved = {}  # (tokenizer_model, format) -> (Tokenizer, format): a gateway resolves the same pair per request


def resolve(tokenizer_model, format=None):
    """(Tokenizer, prompt format name) for a tokenizer_model and an optional explicit format. Decided once per
    pair (a directory's files are read the first time only). A Tokenizer object is used as it is, with format=
    (a tokenizer alone does not say its prompt format)."""
    if isinstance(tokenizer_model, _core.Tokenizer):
        if format is None:
            raise ValueError("a Tokenizer object names no prompt format: pass format= (one of %s)" % ", ".join(FORMATS))
        return tokenizer_model, _check_format(format)
    key = (os.fspath(tokenizer_model) if isinstance(tokenizer_model, os.PathLike) else tokenizer_model, format)
    try:
        return _resolved[key]
    except (KeyError, TypeError):  # TypeError: an unhashable tokenizer_model, refused below
        pass
    result = _resolve(tokenizer_model, format)
    _resolved[key] = result
    return result


def _resolve(tokenizer_model, format):
    if format is not None:
        _check_format(format)
    if tokenizer_model is None:
        if format is None:
            raise ValueError("pass tokenizer_model= (a directory holding tokenizer.json, or one of: %s) "
                             "or format= (one of %s)" % (_known_names(), ", ".join(FORMATS)))
        return _load(os.path.join(_PACKAGE_TOKENIZER, "tokenizer.json")), format
    file, directory, fmt = _tokenizer_file(tokenizer_model)
    if format is not None:
        fmt = format
    elif fmt is None:
        fmt = detect_format(directory)
        if fmt is None:
            raise ValueError("cannot tell the prompt format of %s (its tokenizer_config.json and config.json name "
                             "no model we know): pass format=, one of %s" % (directory, ", ".join(FORMATS)))
    return _load(file), fmt
