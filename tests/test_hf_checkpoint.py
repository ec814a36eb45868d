"""Hugging Face checkpoint directories (config.json + safetensors + tokenizer files) run like GGUF
files: same logits and token ids, sharded checkpoints, and errors that name what is wrong."""

import json

import pytest
import torch

from unikv.engine.config import ModelLoadError
from unikv.engine.loading import load_model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, loaded):
    """The packaged SmolLM2 re-saved in Hugging Face layout by `save_hf`."""
    from unikv.engine.hf_loader import save_hf

    path = tmp_path_factory.mktemp("smollm2-hf")
    save_hf(*loaded, path)
    return path


@pytest.mark.slow
def test_checkpoint_dir_matches_the_gguf_model(hf_dir, model, tokenizer, capsys):
    ours, tok = load_model(str(hf_dir), progress=False)
    text = "The KV cache keeps keys and values. <|im_start|>user\nHi<|im_end|>"
    assert tok.encode(text) == tokenizer.encode(text)
    assert tok.eos_id == tokenizer.eos_id and tok.chat_template == tokenizer.chat_template
    assert tok.special_ids == tokenizer.special_ids
    ids = torch.tensor(tokenizer.encode("Paris is the capital of France. It is"))
    from unikv.kvstrategies.kv import ContiguousKVCache, StepBatch

    def logits(m):
        cfg = m.cfg
        kv = ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32)
        n = ids.shape[0]
        return m.forward(ids, torch.arange(n), kv, StepBatch([0], [n]), torch.arange(n))

    assert torch.allclose(logits(ours), logits(model), atol=1e-4)
    assert ours.cfg.identity != model.cfg.identity  # another file: another weights digest
    # transformers reads the directory as its own: same logits.
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.allclose(theirs(ids[None]).logits[0], logits(model), atol=1e-4)
    from unikv.cli.main import main

    argv = ["run", "--model", str(hf_dir), "--prompt", "What is the capital of France?"]
    assert main([*argv, "--chat", "--max-new-tokens", "8", "--strategy", "full"]) == 0
    assert "Paris" in capsys.readouterr().out


def tiny(tmp_path, **config):
    """A small random Llama checkpoint saved by transformers (optionally sharded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                      **config)  # fmt: skip
    m = LlamaForCausalLM(cfg).eval()
    m.save_pretrained(tmp_path, max_shard_size="100KB")
    return m


def test_sharded_checkpoint_logits_match_transformers(tmp_path):
    from unikv.engine.hf_loader import load_hf
    from unikv.engine.model import LlamaModel
    from unikv.kvstrategies.kv import ContiguousKVCache, StepBatch

    ref = tiny(tmp_path, rope_theta=5000.0)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    cfg, tensors = load_hf(tmp_path, progress=False)
    assert cfg.num_kv_heads == 2 and cfg.rope_theta == 5000.0 and not cfg.tie_embeddings
    m = LlamaModel(cfg, tensors)
    ids = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(1))
    kv = ContiguousKVCache(2, 2, 16, torch.float32)
    ours = m.forward(ids, torch.arange(12), kv, StepBatch([0], [12]), torch.arange(12))
    with torch.no_grad():
        theirs = ref(ids[None]).logits[0]
    assert torch.allclose(ours, theirs, atol=1e-4)


def test_bad_checkpoints_name_what_is_wrong(tmp_path):
    from safetensors.torch import load_file, save_file

    from unikv.engine.hf_loader import load_hf

    tiny(tmp_path)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = tmp_path / index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    tensors = load_file(shard)
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(128, 32)
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model.layers.1.mlp.up_proj.weight has shape "
                       r"\(128, 32\), want \(128, 64\)"):  # fmt: skip
        load_hf(tmp_path, progress=False)
    shard.unlink()
    with pytest.raises(ModelLoadError, match=f"shard {shard.name} is missing"):
        load_hf(tmp_path, progress=False)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"architectures": ["GPT2LMHead"]}))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'GPT2LMHead'"):
        load_hf(tmp_path, progress=False)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ModelLoadError, match="config.json: missing key 'num_attention_heads'"):
        load_hf(tmp_path, progress=False)
    with pytest.raises(ModelLoadError, match="without config.json"):
        load_model(str(tmp_path / ".."), progress=False)
