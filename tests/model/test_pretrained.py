"""`HybridModel.from_pretrained` on a Kimi-Linear-style checkpoint the test writes in the published
layout (sharded safetensors + index, HF names), against a forward written here from the HF formulas."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from k3sys.model import HybridCache, HybridModel, ModelConfig, count_params
from k3sys.model.hf import config_from_hf
from kda.fla_reference import fla_layer_reference, random_state_dict

# moonshotai/Kimi-Linear-48B-A3B-Instruct config.json (the keys the architecture reads)
PUBLISHED = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "torch_dtype": "bfloat16",
    "vocab_size": 163840, "hidden_size": 2304, "num_hidden_layers": 27, "num_attention_heads": 32,
    "num_key_value_heads": 32, "head_dim": 72, "intermediate_size": 9216, "hidden_act": "silu",
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "model_max_length": 1048576,
    "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "mla_use_nope": True, "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1,
    "moe_intermediate_size": 1024, "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
    "routed_scaling_factor": 2.446, "first_k_dense_replace": 1, "moe_layer_freq": 1, "use_grouped_topk": True,
    "num_expert_group": 1, "topk_group": 1, "num_nextn_predict_layers": 0,
    "linear_attn_config": {"kda_layers": [i for i in range(1, 28) if i % 4 and i != 27],
                           "full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "num_heads": 32, "head_dim": 128,
                           "short_conv_kernel_size": 4},
}

TINY = {**PUBLISHED, "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 6, "num_attention_heads": 2,
        "num_key_value_heads": 2, "intermediate_size": 48, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4, "v_head_dim": 8, "num_experts": 4, "num_experts_per_token": 2,
        "moe_intermediate_size": 16, "model_max_length": 4096, "torch_dtype": "float64",
        "num_nextn_predict_layers": 1,
        "linear_attn_config": {"kda_layers": [1, 2, 3, 5], "full_attn_layers": [4, 6], "num_heads": 2,
                               "head_dim": 8, "short_conv_kernel_size": 4}}


def kimi_linear_layout(hf: dict) -> dict[str, tuple]:
    """Every tensor a Kimi-Linear checkpoint holds for `hf` (config.json), with its shape, as the
    architecture (HF modeling_kimi.py, vLLM kimi_linear.py) declares them."""
    D, V = hf["hidden_size"], hf["vocab_size"]
    lac = hf["linear_attn_config"]
    H, K, W = lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]
    Hm, r, dn, dr, dv = (hf[k] for k in ("num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
                                          "qk_rope_head_dim", "v_head_dim"))
    F_, E, Fe = hf["intermediate_size"], hf["num_experts"], hf["moe_intermediate_size"]
    out = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D)}
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,)})
        a = p + "self_attn."
        if i + 1 in lac["kda_layers"]:
            for n in "qkv":
                out.update({f"{a}{n}_proj.weight": (H * K, D), f"{a}{n}_conv1d.weight": (H * K, 1, W)})
            out.update({a + "A_log": (1, 1, H, 1), a + "dt_bias": (H * K,), a + "b_proj.weight": (H, D),
                        a + "f_a_proj.weight": (K, D), a + "f_b_proj.weight": (H * K, K),
                        a + "g_a_proj.weight": (K, D), a + "g_b_proj.weight": (H * K, K),
                        a + "o_norm.weight": (K,), a + "o_proj.weight": (D, H * K)})
        else:
            out.update({a + "q_proj.weight": (Hm * (dn + dr), D), a + "kv_a_proj_with_mqa.weight": (r + dr, D),
                        a + "kv_a_layernorm.weight": (r,), a + "kv_b_proj.weight": (Hm * (dn + dv), r),
                        a + "o_proj.weight": (D, Hm * dv)})
        if i >= hf["first_k_dense_replace"]:
            m = p + "block_sparse_moe."
            out.update({m + "gate.weight": (E, D), m + "gate.e_score_correction_bias": (E,)})
            for e in range(E):
                out.update({f"{m}experts.{e}.w1.weight": (Fe, D), f"{m}experts.{e}.w3.weight": (Fe, D),
                            f"{m}experts.{e}.w2.weight": (D, Fe)})
            S = Fe * hf["num_shared_experts"]
            out.update({m + "shared_experts.gate_proj.weight": (S, D), m + "shared_experts.up_proj.weight": (S, D),
                        m + "shared_experts.down_proj.weight": (D, S)})
        else:
            out.update({p + "mlp.gate_proj.weight": (F_, D), p + "mlp.up_proj.weight": (F_, D),
                        p + "mlp.down_proj.weight": (D, F_)})
    return out


def test_kimi_linear_preset_is_the_published_config_and_holds_its_parameters():
    preset = ModelConfig.from_preset("kimi-linear-48b")
    assert config_from_hf(PUBLISHED, name="kimi-linear-48b") == preset
    layout = sum(math.prod(s) for s in kimi_linear_layout(PUBLISHED).values())
    assert count_params(preset)["total"] == layout == 49_122_681_728


def write_checkpoint(path, hf: dict, shards: int = 3, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random fp64 tensors in the published layout, sharded by layer, with the index; returns them."""
    tensors = random_state_dict(kimi_linear_layout(hf), seed=seed)
    # a multi-token-prediction layer after the last one: the loader must skip it
    tensors[f"model.layers.{hf['num_hidden_layers']}.input_layernorm.weight"] = torch.ones(hf["hidden_size"])
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {}
    for n in tensors:
        layer = int(n.split(".")[2]) if n.startswith("model.layers.") else -1
        weight_map[n] = files[(layer + 1) % shards]
    for f in files:
        save_file({n: tensors[n].contiguous() for n in tensors if weight_map[n] == f}, str(path / f))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                    "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(hf))
    return tensors


def rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def swiglu(x, gate, up, down):
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


def reference_logits(t: dict[str, torch.Tensor], hf: dict, ids: torch.Tensor) -> torch.Tensor:
    """Kimi Linear's forward from the HF formulas (modeling_kimi.py), straight from the checkpoint tensors."""
    eps, lac = hf["rms_norm_eps"], hf["linear_attn_config"]
    Hm, r, dn, dr, dv = (hf[k] for k in ("num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
                                          "qk_rope_head_dim", "v_head_dim"))
    h = t["model.embed_tokens.weight"][ids]
    B, T, _ = h.shape
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = {n[len(p + "self_attn."):]: x for n, x in t.items() if n.startswith(p + "self_attn.")}
        x = rms(h, t[p + "input_layernorm.weight"], eps)
        if i + 1 in lac["kda_layers"]:  # fla's layer under Kimi's names; A_log [1, 1, H, 1]; no gate bias
            fla = {**a, "f_proj.0.weight": a["f_a_proj.weight"], "f_proj.1.weight": a["f_b_proj.weight"],
                   "g_proj.0.weight": a["g_a_proj.weight"], "g_proj.1.weight": a["g_b_proj.weight"],
                   "A_log": a["A_log"].flatten()}
            o, _ = fla_layer_reference(fla, x, lac["num_heads"], lac["head_dim"], norm_eps=eps)
        else:  # MLA, NoPE: the rope slice of q and the shared k_rot go in unrotated
            q = (x @ a["q_proj.weight"].T).view(B, T, Hm, dn + dr)
            c, k_rot = (x @ a["kv_a_proj_with_mqa.weight"].T).split([r, dr], dim=-1)
            kv = (rms(c, a["kv_a_layernorm.weight"], eps) @ a["kv_b_proj.weight"].T).view(B, T, Hm, dn + dv)
            k = torch.cat([kv[..., :dn], k_rot[:, :, None].expand(B, T, Hm, dr)], dim=-1)
            s = torch.einsum("bthd,bshd->bhts", q, k) * (dn + dr) ** -0.5
            s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
            o = torch.einsum("bhts,bshd->bthd", s.softmax(-1), kv[..., dn:]).reshape(B, T, Hm * dv)
            o = o @ a["o_proj.weight"].T
        h = h + o
        x = rms(h, t[p + "post_attention_layernorm.weight"], eps)
        if i < hf["first_k_dense_replace"]:
            h = h + swiglu(x, *(t[f"{p}mlp.{n}_proj.weight"] for n in ("gate", "up", "down")))
            continue
        m = p + "block_sparse_moe."
        scores = torch.sigmoid(x @ t[m + "gate.weight"].T)  # [B, T, E]
        idx = (scores + t[m + "gate.e_score_correction_bias"]).topk(hf["num_experts_per_token"], dim=-1).indices
        w = scores.gather(-1, idx)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) * hf["routed_scaling_factor"]
        every = torch.stack([swiglu(x, *(t[f"{m}experts.{e}.{n}.weight"] for n in ("w1", "w3", "w2")))
                             for e in range(hf["num_experts"])], dim=-2)  # [B, T, E, D]
        routed = (every.gather(-2, idx[..., None].expand(*idx.shape, every.shape[-1])) * w[..., None]).sum(-2)
        shared = swiglu(x, *(t[f"{m}shared_experts.{n}_proj.weight"] for n in ("gate", "up", "down")))
        h = h + routed + shared
    return rms(h, t["model.norm.weight"], eps) @ t["lm_head.weight"].T


@pytest.fixture
def checkpoint(tmp_path):
    torch.set_num_threads(1)
    return tmp_path, write_checkpoint(tmp_path, TINY)


def test_from_pretrained_matches_the_reference_forward(checkpoint):
    path, tensors = checkpoint
    model = HybridModel.from_pretrained(path)
    assert model.cfg.layers == ("kda", "kda", "kda", "mla", "kda", "mla") and not model.training
    assert all(p.dtype == torch.float64 and p.device.type == "cpu" for p in model.parameters())
    ids = torch.randint(0, TINY["vocab_size"], (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids)
        ref = reference_logits(tensors, TINY, ids)
        assert ((logits - ref).norm() / ref.norm()).item() < 1e-12
        cache = HybridCache(model.cfg, batch=2, dtype=torch.float64)  # and decode continues it
        model(ids[:, :15], cache)
        stepped = torch.cat([model(ids[:, t:t + 1], cache) for t in range(15, 21)], dim=1)
    assert ((stepped - ref[:, 15:]).norm() / ref[:, 15:].norm()).item() < 1e-12


def test_from_pretrained_casts_to_a_dtype(checkpoint):
    path, tensors = checkpoint
    model = HybridModel.from_pretrained(path, dtype=torch.float32)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    ids = torch.randint(0, TINY["vocab_size"], (1, 9))
    with torch.no_grad():
        ref = reference_logits(tensors, TINY, ids)
        assert ((model(ids).double() - ref).norm() / ref.norm()).item() < 1e-5


def test_a_single_file_checkpoint_loads_too(tmp_path):
    tensors = random_state_dict(kimi_linear_layout(TINY), seed=3)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    model = HybridModel.from_pretrained(tmp_path)
    w2 = tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    assert torch.equal(model.blocks[1].ffn.experts.w_down[3], w2.T)


@pytest.mark.parametrize("change, match", [
    ({"num_expert_group": 8}, r"unsupported Kimi-Linear setting\(s\) \{'num_expert_group': 8\}"),
    ({"moe_layer_freq": 2}, r"'moe_layer_freq': 2"),
    ({"tie_word_embeddings": True}, r"'tie_word_embeddings': True"),
    ({"q_lora_rank": 8, "mla_use_nope": False}, r"\{'mla_use_nope': False, 'q_lora_rank': 8\}"),
    ({"linear_attn_config": {**TINY["linear_attn_config"], "full_attn_layers": [4]}},
     r"kda_layers \[1, 2, 3, 5\] and full_attn_layers \[4\] must split layers 1..6"),
])
def test_unsupported_configs_are_named(change, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf({**TINY, **change})


def test_missing_and_unused_tensors_are_named(tmp_path):
    tensors = random_state_dict(kimi_linear_layout(TINY))
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    missing = {n: t for n, t in tensors.items() if n != "model.layers.4.self_attn.dt_bias"}
    save_file(missing, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"checkpoint has no tensor 'model.layers.4.self_attn.dt_bias'"):
        HybridModel.from_pretrained(tmp_path)
    save_file({**tensors, "model.layers.3.self_attn.g_proj.weight": torch.zeros(16, 32)},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"no place for: \['model.layers.3.self_attn.g_proj.weight'\]"):
        HybridModel.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="has no config.json"):
        HybridModel.from_pretrained(tmp_path / "nowhere")
