"""Writes the built-in corpus's tokenizer and tokens at the default vocabulary into
hslm/corpus/, as the token cache names and writes them (hslm.data.BUILTIN_TOKENS).

A machine's first default run then loads them instead of learning a tokenizer, and so
compiles no tokenizer kernels (about 9 s of its first-run compile). Run
`python tools/ship_builtin_tokens.py` after any change to the tokenizer, the token
cache's format or the built-in text; tests/test_data.py checks that the shipped files
are exactly what learning writes.
"""
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hslm import data, token_cache  # noqa: E402
from hslm.config import Config  # noqa: E402


def learn_builtin(folder: Path):
    """Learn the built-in text's tokenizer at the default vocabulary into `folder` (a
    token cache), ignoring the shipped files; returns the two files' paths."""
    shipped, data.BUILTIN_TOKENS = data.BUILTIN_TOKENS, None
    try:
        vocab = Config().vocab
        src = data.TextSource(text=data.builtin_text(), label=data.BUILTIN_SOURCE)
        tok, _ = data.corpus_tokens(src, data.BUILTIN_SHA256, vocab, cache_dir=folder)
    finally:
        data.BUILTIN_TOKENS = shipped
    return (token_cache.tokenizer_path(folder, data.BUILTIN_SHA256, vocab),
            token_cache.tokens_path(folder, data.BUILTIN_SHA256, tok.identity))


def main():
    for old in list(data.BUILTIN_TOKENS.glob("bpe-*.json")) + list(
            data.BUILTIN_TOKENS.glob("tokens-*.tok")):
        old.unlink()
    with tempfile.TemporaryDirectory() as d:
        for path in learn_builtin(Path(d)):
            shutil.copyfile(path, data.BUILTIN_TOKENS / path.name)
            print(f"wrote {data.BUILTIN_TOKENS / path.name}")


if __name__ == "__main__":
    if len(sys.argv) > 1:  # (--help included: this tool rewrites package files)
        sys.exit("usage: python tools/ship_builtin_tokens.py   (no arguments; rewrites "
                 "hslm/corpus/'s bpe-*.json and tokens-*.tok)")
    main()
