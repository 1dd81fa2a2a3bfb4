"""DeepSeek-V3 architecture in plain PyTorch, for training the demo model (tools/train_demo_model.py) and for
checking it against the fixtures' Hugging Face reference logits (tools/check_demo_model_arch.py).

Written from the papers and from what our engine computes (src/model/deepseek_model.cpp), not copied:
  - MLA (DeepSeek-V2 §2.1): q = q_b(RMSNorm(q_a(x))) (or q_proj(x)); [c_kv | k_rope] = kv_a(x);
    [k_nope | v] = kv_b(RMSNorm(c_kv)); rope on the last qk_rope_head_dim of q and on k_rope (shared by all
    heads), pairs (2i, 2i+1) rotated together (the interleaved layout of the real checkpoints); softmax scale
    qk_head_dim^-1/2, times YaRN's mscale(factor, mscale_all_dim)^2 when rope_scaling is set.
  - MoE with the V3 router (DeepSeek-V3 §2.1.2, `noaux_tc`): s = sigmoid(x W_gate^T) in float32; the choice
    uses s + e_score_correction_bias, group-limited: the topk_group groups with the largest sum of their top-2
    choice scores, other groups' choices set to 0; top num_experts_per_tok; weights = s of the chosen,
    renormalised when norm_topk_prob, times routed_scaling_factor; plus the shared experts.
  - layers < first_k_dense_replace use a dense SwiGLU MLP.
  - MTP (DeepSeek-V3 §2.2) as vLLM's DeepSeekMTP applies release checkpoints: the main model's final hidden
    state h_i (after model.norm, the vector lm_head sees), h'_i = eh_proj([enorm(Emb(t_{i+1})); hnorm(h_i)])
    (embedding first, as our tensor_names.cpp documents), one decoder layer (MoE or dense as the config says
    for layer index num_hidden_layers), then shared_head.norm and the head shared with the main model;
    predicts t_{i+2}.

Runs under torch 1.13 (Debian, CPU) and torch 2.x (GPU): nothing newer than 1.13 is used unguarded.
The vocabulary may be "compact": only `kept` rows of the 129,280-row embedding and head are parameters, the
other rows are exactly zero (never-seen tokens: their embedding is the zero vector, their logit exactly 0).
`logsumexp` over the full vocabulary is then logaddexp(logsumexp(kept logits), log(#zero rows)), exactly.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn


def config_value(config, key, default):
    value = config.get(key, default)
    return default if value is None else value


def compute_float(x):
    """float32 for bf16/float32 inputs; float64 stays float64 (the float64 reference computations)."""
    return x if x.dtype == torch.float64 else x.float()


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = compute_float(x)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def yarn_inv_freq(config):
    """Rope inverse frequencies and the cos/sin attention factor (YaRN, arXiv:2309.00071, as the engine)."""
    dim = config["qk_rope_head_dim"]
    base = float(config_value(config, "rope_theta", 10000.0))
    pos_freq = base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    rope = config.get("rope_scaling")
    if not rope or rope.get("type", rope.get("rope_type")) in (None, "default"):
        return (1.0 / pos_freq).float(), 1.0
    factor = float(rope["factor"])
    orig = float(rope.get("original_max_position_embeddings", 4096))
    beta_fast, beta_slow = float(rope.get("beta_fast", 32)), float(rope.get("beta_slow", 1))
    mscale, mscale_all_dim = float(rope.get("mscale", 1)), float(rope.get("mscale_all_dim", 0))

    def get_mscale(scale, m):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
    else:
        attention_factor = get_mscale(factor, 1.0)

    def correction_dim(rotations):
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_factor = 1 - ramp
    pos_freq = pos_freq.float()
    inv = (1.0 / (factor * pos_freq)) * (1 - extrapolation_factor) + (1.0 / pos_freq) * extrapolation_factor
    return inv, attention_factor


def softmax_scale(config):
    scale = (config["qk_nope_head_dim"] + config["qk_rope_head_dim"]) ** -0.5
    rope = config.get("rope_scaling")
    if rope and rope.get("type", rope.get("rope_type")) == "yarn":
        m_all = float(rope.get("mscale_all_dim", 0))
        factor = float(rope["factor"])
        if m_all and factor > 1:
            m = 0.1 * m_all * math.log(factor) + 1.0
            scale *= m * m
    return scale


def apply_rope(x, cos, sin):
    """x [..., T, R] with pairs (2i, 2i+1); cos/sin [T, R/2]. Returns the rotated pairs, evens then odds (the
    de-interleaved order; q and k use the same order, so q.k is that of the interleaved rotation)."""
    even, odd = x[..., 0::2], x[..., 1::2]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # bf16 under autocast: q and k stay one dtype for SDPA
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        h, heads = c["hidden_size"], c["num_attention_heads"]
        self.heads, self.nope, self.rope, self.v = heads, c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
        self.rank = c["kv_lora_rank"]
        qk = self.nope + self.rope
        eps = config_value(c, "rms_norm_eps", 1e-6)
        self.q_lora_rank = c.get("q_lora_rank")
        if self.q_lora_rank:
            self.q_a_proj = nn.Linear(h, self.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, heads * qk, bias=False)
        else:
            self.q_proj = nn.Linear(h, heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.rank, eps)
        self.kv_b_proj = nn.Linear(self.rank, heads * (self.nope + self.v), bias=False)
        self.o_proj = nn.Linear(heads * self.v, h, bias=False)
        self.scale = softmax_scale(c)

    def forward(self, x, cos, sin, mask=None):
        """cos/sin [T, R/2], or [B, 1, T, R/2] with per-row positions; mask: None (causal) or bool [B, 1, T, T]."""
        B, T, _ = x.shape
        H = self.heads
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(B, T, H, self.nope + self.rope).transpose(1, 2)
        q_nope, q_rope = q[..., : self.nope], q[..., self.nope:]
        kv_a = self.kv_a_proj_with_mqa(x)
        latent, k_rope = kv_a[..., : self.rank], kv_a[..., self.rank:]
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(B, T, H, self.nope + self.v).transpose(1, 2)
        k_nope, value = kv[..., : self.nope], kv[..., self.nope:]
        q_rope = apply_rope(q_rope, cos, sin)
        k_rope = apply_rope(k_rope.unsqueeze(1), cos, sin).expand(B, H, T, self.rope)
        query = torch.cat([q_nope, q_rope], dim=-1)
        key = torch.cat([k_nope, k_rope], dim=-1)
        if hasattr(F, "scaled_dot_product_attention") and query.is_cuda:
            if mask is None:
                out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=self.scale)
            else:
                out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=self.scale)
        else:
            scores = torch.matmul(query, key.transpose(-1, -2)) * self.scale
            if mask is None:
                mask = ~torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(~mask, float("-inf"))
            out = torch.matmul(torch.softmax(compute_float(scores), dim=-1).to(value.dtype), value)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, H * self.v))


class Mlp(nn.Module):
    def __init__(self, hidden, inter):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Gate(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(c["n_routed_experts"], c["hidden_size"]))
        # Trained by the aux-loss-free update (DeepSeek-V3 §2.1.2), not by gradients: a buffer.
        self.register_buffer("e_score_correction_bias", torch.zeros(c["n_routed_experts"]))


class Moe(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.n, self.k = c["n_routed_experts"], c["num_experts_per_tok"]
        self.n_group, self.topk_group = c["n_group"], c["topk_group"]
        self.norm_topk_prob = c["norm_topk_prob"]
        self.routed_scaling_factor = float(c["routed_scaling_factor"])
        self.gate = Gate(c)
        h, inter = c["hidden_size"], c["moe_intermediate_size"]
        self.experts = nn.ModuleList([Mlp(h, inter) for _ in range(self.n)])
        shared = c.get("n_shared_experts") or 0
        self.shared_experts = Mlp(h, inter * shared) if shared else None
        self.last_load = None  # [n] tokens routed to each expert in the last forward (for the bias update)

    def route(self, x):
        """x [N, hidden] -> (ids [N, k], weights [N, k] float32)."""
        with torch.autocast(device_type=x.device.type, enabled=False):  # the router stays float32
            logits = F.linear(x.float(), self.gate.weight.float())
        scores = torch.sigmoid(logits)
        choice = scores + self.gate.e_score_correction_bias.float()
        N = x.shape[0]
        per_group = self.n // self.n_group
        grouped = choice.view(N, self.n_group, per_group)
        group_scores = grouped.topk(min(2, per_group), dim=-1)[0].sum(-1)
        top_groups = group_scores.topk(self.topk_group, dim=-1)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, top_groups, 1.0).bool()
        choice = grouped.masked_fill(~group_mask.unsqueeze(-1), 0.0).view(N, self.n)
        ids = choice.topk(self.k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob and self.k > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return ids, weights * self.routed_scaling_factor

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        ids, weights = self.route(x)
        # Dense combine matrix [N, n]: the experts are tiny next to the 129,280-wide head, so every expert runs
        # on every token and unchosen outputs are multiplied by exactly 0 (same sums as a gather/scatter).
        combine = torch.zeros(x.shape[0], self.n, dtype=torch.float32, device=x.device).scatter_(1, ids, weights)
        with torch.no_grad():
            self.last_load = torch.zeros(self.n, device=x.device).scatter_add_(
                0, ids.reshape(-1), torch.ones(ids.numel(), device=x.device))
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + expert(x) * combine[:, e: e + 1].to(x.dtype)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(shape)


class DecoderLayer(nn.Module):
    def __init__(self, c, index):
        super().__init__()
        eps = config_value(c, "rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(c["hidden_size"], eps)
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], eps)
        self.self_attn = Attention(c)
        moe = (c.get("n_routed_experts") or 0) > 0 and index >= c.get("first_k_dense_replace", 0) and \
            index % c.get("moe_layer_freq", 1) == 0
        self.mlp = Moe(c) if moe else Mlp(c["hidden_size"], c["intermediate_size"])

    def forward(self, x, cos, sin, mask=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class MtpLayer(DecoderLayer):
    def __init__(self, c, index):
        super().__init__(c, index)
        eps = config_value(c, "rms_norm_eps", 1e-6)
        h = c["hidden_size"]
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.shared_head_norm = RMSNorm(h, eps)


class DeepSeekV3(nn.Module):
    """`kept`: sorted full-vocabulary ids that have rows (None: all). Token ids given to forward() are
    compact indices into `kept`; logits are over the kept rows only (see the module docstring)."""

    def __init__(self, c, kept=None):
        super().__init__()
        self.config = c
        self.vocab_size = c["vocab_size"]
        self.kept = None if kept is None else torch.as_tensor(kept, dtype=torch.long)
        rows = self.vocab_size if kept is None else len(kept)
        h = c["hidden_size"]
        self.embed_tokens = nn.Embedding(rows, h)
        self.layers = nn.ModuleList([DecoderLayer(c, i) for i in range(c["num_hidden_layers"])])
        self.norm = RMSNorm(h, config_value(c, "rms_norm_eps", 1e-6))
        self.lm_head = nn.Linear(h, rows, bias=False)
        n_mtp = c.get("num_nextn_predict_layers") or 0
        self.mtp = nn.ModuleList([MtpLayer(c, c["num_hidden_layers"] + i) for i in range(n_mtp)])
        inv_freq, attention_factor = yarn_inv_freq(c)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_factor = attention_factor
        # log(number of zero rows): the constant logit mass of the never-seen tokens.
        zero_rows = self.vocab_size - rows
        self.log_zero_rows = math.log(zero_rows) if zero_rows > 0 else None

    def rope_tables(self, T, device, dtype, pad=None):
        pos = torch.arange(T, device=device, dtype=torch.float32)
        if pad is not None:  # left padding: row b's real tokens start at column pad[b], at position 0
            pos = (pos[None] - pad[:, None].float()).clamp(min=0)[:, None]  # [B, 1, T]
        freqs = pos[..., None] * self.inv_freq.to(device)
        return (freqs.cos() * self.attention_factor).to(dtype), (freqs.sin() * self.attention_factor).to(dtype)

    @staticmethod
    def pad_mask(T, pad):
        """Causal mask over left-padded rows; a padding query sees itself only (no empty softmax rows)."""
        col = torch.arange(T, device=pad.device)
        causal = col[None, :] <= col[:, None]
        real_key = col[None, :] >= pad[:, None]  # [B, T]
        eye = torch.eye(T, dtype=torch.bool, device=pad.device)
        return (causal[None] & real_key[:, None, :]) | eye[None]  # [B, T, T]

    def hidden(self, ids, pad=None):
        """ids [B, T] (compact) -> final hidden states after model.norm [B, T, hidden]. pad [B]: left padding."""
        x = self.embed_tokens(ids)
        dtype = x.dtype if x.dtype == torch.float64 else torch.float32
        cos, sin = self.rope_tables(ids.shape[1], ids.device, dtype, pad)
        mask = None if pad is None else self.pad_mask(ids.shape[1], pad)[:, None]
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.norm(x)

    def mtp_hidden(self, h, next_ids, depth=0):
        """h [B, T, hidden] (main final hidden, positions 0..T-1), next_ids [B, T] = tokens t_{i+1}: the MTP
        layer's hidden state before shared_head.norm's head, predicting t_{i+2} at position i."""
        m = self.mtp[depth]
        cos, sin = self.rope_tables(h.shape[1], h.device, h.dtype if h.dtype == torch.float64 else torch.float32)
        x = m.eh_proj(torch.cat([m.enorm(self.embed_tokens(next_ids)), m.hnorm(h)], dim=-1))
        x = m(x, cos, sin)
        return m.shared_head_norm(x)

    def full_logits(self, logits):
        """Compact logits [..., rows] -> full-vocabulary logits [..., vocab] (zero for never-seen tokens)."""
        if self.kept is None:
            return logits
        full = logits.new_zeros(*logits.shape[:-1], self.vocab_size)
        full[..., self.kept.to(logits.device)] = logits
        return full

    def cross_entropy(self, logits, targets):
        """Mean cross entropy over the full vocabulary (zero rows included exactly), targets compact."""
        logits = logits.float()
        if self.log_zero_rows is not None:
            extra = torch.full_like(logits[..., :1], self.log_zero_rows)
            logits = torch.cat([logits, extra], dim=-1)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    # Checkpoint names (Hugging Face / DeepSeek release layout) -> tensors, full vocabulary rows.
    def export_state(self):
        out = {}
        kept = self.kept

        def full_rows(w):
            if kept is None:
                return w
            full = w.new_zeros(self.vocab_size, w.shape[1])
            full[kept] = w
            return full

        def layer_state(prefix, layer):
            for name, tensor in layer.state_dict().items():
                if name.startswith(("enorm", "hnorm", "eh_proj", "shared_head_norm")):
                    continue
                out[prefix + name] = tensor

        out["model.embed_tokens.weight"] = full_rows(self.embed_tokens.weight.detach())
        for i, layer in enumerate(self.layers):
            layer_state("model.layers.%d." % i, layer)
        out["model.norm.weight"] = self.norm.weight.detach()
        out["lm_head.weight"] = full_rows(self.lm_head.weight.detach())
        for d, m in enumerate(self.mtp):
            p = "model.layers.%d." % (self.config["num_hidden_layers"] + d)
            out[p + "enorm.weight"] = m.enorm.weight.detach()
            out[p + "hnorm.weight"] = m.hnorm.weight.detach()
            out[p + "eh_proj.weight"] = m.eh_proj.weight.detach()
            out[p + "shared_head.norm.weight"] = m.shared_head_norm.weight.detach()
            layer_state(p, m)
            # embed_tokens and shared_head.head: copies of the shared ones, as DeepSeek's checkpoints store them
            # (written by tools/unpack_demo_model.py, not stored twice in the compressed artifact).
        return {k: v.detach().contiguous() for k, v in out.items()}

    def load_checkpoint_state(self, tensors):
        """Loads checkpoint-named tensors (full vocabulary; requires kept is None)."""
        assert self.kept is None
        own = {}
        own["embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
        own["norm.weight"] = tensors["model.norm.weight"]
        own["lm_head.weight"] = tensors["lm_head.weight"]
        L = self.config["num_hidden_layers"]
        for name, t in tensors.items():
            if not name.startswith("model.layers."):
                continue
            index, rest = name[len("model.layers."):].split(".", 1)
            index = int(index)
            if index < L:
                own["layers.%d.%s" % (index, rest)] = t
            elif index - L < len(self.mtp):
                if rest in ("embed_tokens.weight", "shared_head.head.weight"):
                    continue
                rest = rest.replace("shared_head.norm", "shared_head_norm")
                own["mtp.%d.%s" % (index - L, rest)] = t
        missing, unexpected = self.load_state_dict(own, strict=False)
        missing = [m for m in missing if m != "inv_freq"]
        if missing or unexpected:
            raise ValueError("checkpoint mismatch: missing %s unexpected %s" % (missing, unexpected))
