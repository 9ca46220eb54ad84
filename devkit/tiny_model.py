"""Build the tiny random-weight Llama that the demo and the tests serve on CPU.

No download: the tokenizer is trained here on a fixed text, the weights are random with a
fixed seed. head_dim is 64 because vLLM's CPU attention kernel rejects smaller heads.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

MODEL_NAME = "tiny-llama"
VOCAB_SIZE = 512
MAX_POSITIONS = 2048

_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}</s>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_CORPUS = """\
OpenTelemetry traces show where a request spends its time. A large language model server
queues a request, computes the prefill of the prompt, and then decodes one token after another.
Platform teams bill tenants by tokens: input tokens, cached input tokens and output tokens.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 hello world, how are you today?
"""


def build(out_dir: Path, seed: int = 0) -> Path:
    """Write config, weights, tokenizer and chat template to out_dir (idempotent)."""
    out_dir = Path(out_dir)
    marker = out_dir / "otel-llm-tiny-model.json"
    if marker.exists():
        return out_dir
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    special = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", model_max_length=MAX_POSITIONS
    )
    fast.chat_template = _CHAT_TEMPLATE

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    fast.save_pretrained(out_dir)
    marker.write_text(json.dumps({"name": MODEL_NAME, "seed": seed}))
    return out_dir


# A wider, deeper network for the tiny tokenizer, served with vLLM's made-up weights
# (`--load-format dummy`, nothing to write or load). Its engine step is ~10x the tiny model's, which
# the API server keeps up with on a loaded machine: with the tiny model's ~2 ms step, vLLM's API
# server falls behind its output socket (pyzmq hands it ready messages without yielding the event
# loop), runs neither SSE writers nor disconnect listeners until the engine stops, and a client
# that leaves a stream is never seen to leave.
PACED_NETWORK = {
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "max_position_embeddings": 4096,
}
PACED_SERVE_ARGS = ("--load-format", "dummy")


def _copy_all_but_weights(tiny_dir: Path, out_dir: Path) -> None:
    """The tiny model's tokenizer, chat template and config, for a variant to change."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for item in tiny_dir.iterdir():
        if item.is_file() and item.suffix != ".safetensors" and item.name != "otel-llm-tiny-model.json":
            (out_dir / item.name).write_bytes(item.read_bytes())


def build_paced(out_dir: Path, tiny_dir: Path) -> Path:
    """The tiny model's tokenizer and chat template on PACED_NETWORK, without weights (idempotent)."""
    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists() and (out_dir / "otel-llm-tiny-model.json").exists():
        return out_dir
    tiny_dir = build(tiny_dir)
    _copy_all_but_weights(tiny_dir, out_dir)
    config = json.loads((tiny_dir / "config.json").read_text())
    config.update(PACED_NETWORK)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "otel-llm-tiny-model.json").write_text(json.dumps({"name": MODEL_NAME, "paced": PACED_NETWORK}))
    return out_dir


def build_scorer(out_dir: Path, tiny_dir: Path, seed: int = 0) -> Path:
    """The tiny model as a one-label sequence classifier (a cross-encoder): vLLM serves /classify,
    /score and /rerank with it. The tiny weights plus a seeded `score` head (idempotent)."""
    out_dir = Path(out_dir)
    if (out_dir / "otel-llm-tiny-model.json").exists():
        return out_dir
    import torch
    from safetensors.torch import load_file, save_file

    tiny_dir = build(tiny_dir)
    _copy_all_but_weights(tiny_dir, out_dir)
    config = json.loads((tiny_dir / "config.json").read_text())
    config.update(
        architectures=["LlamaForSequenceClassification"],
        num_labels=1,
        id2label={"0": "LABEL_0"},
        label2id={"LABEL_0": 0},
        pad_token_id=config.get("eos_token_id"),
    )
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    weights = {k: v for k, v in load_file(tiny_dir / "model.safetensors").items() if not k.startswith("lm_head")}
    generator = torch.Generator().manual_seed(seed)
    weights["score.weight"] = torch.randn(1, config["hidden_size"], generator=generator) * 0.02
    save_file(weights, out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / "otel-llm-tiny-model.json").write_text(json.dumps({"name": MODEL_NAME, "scorer": True}))
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    print(build(args.out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
