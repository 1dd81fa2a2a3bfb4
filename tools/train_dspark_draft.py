"""Trains a DSpark draft module (block-parallel speculative drafter with a low-rank Markov head and a confidence
head) for the built-in demo model by self-distillation, and exports it for tools/unpack_demo_model.py:

  PYTHONUNBUFFERED=1 python3 tools/train_dspark_draft.py --target models/demo --data .train --out $OUT --minutes 5
  /usr/bin/python3 tools/train_dspark_draft.py --target models/demo --data .train --out /tmp/dspark --smoke   (CPU)

On one H200 (--minutes 5): ~10 s start and held-out text, ~60 s generating ~45k training sequences (--gen-seconds),
~20 s target states, the --minutes of training, ~15 s export, final evaluation and reference: ~7 minutes in all.

--target is a checkpoint directory (config.json + model.safetensors, e.g. models/demo) or the packed artifact
(assets/demo-model: config.json + demo-model.xz.NN, unpacked in memory). The target is frozen.

The draft (config keys dspark_target_layer_ids [1, 3], dspark_block_size gamma = 4, dspark_markov_rank r = 16,
dspark_noise_token_id 128799; S = 2 stages; the C++ engine, src/model/deepseek_model.cpp, computes the same):
  - context c_t = main_norm(main_proj([h_1[t] ; h_3[t]])), h_l = the target's residual stream after decoder layer l
    (0-based; the last layer's before model.norm).
  - stage s = a DeepSeek-V3 decoder layer with a dense SwiGLU MLP (intermediate_size). Its attention keys/values:
    for each committed position t < p the injected entry [kv_a_layernorm(kv_a_proj_with_mqa(c_t)[:C]) ;
    rope(kv_a_proj_with_mqa(c_t)[C:], t)] (no input_layernorm on c_t), then the block rows' own entries, causal.
  - a block at anchor position p: rows [anchor, NOISE, NOISE, NOISE] at positions p..p+gamma-1, x = the target's
    embedding (NOISE: the trained row `dspark.noise_embedding`); x += attn(input_layernorm(x)); x += mlp(post_ln(x))
    per stage; h_k = norm(x_k) (the last stage's norm); base_k = lm_head(h_k) (the target's head).
  - logits_k = base_k + markov_w2 @ markov_w1[prev_k], prev_0 = anchor, prev_k = token p+k (at inference: draft k);
    row k predicts token p+k+1. conf_k = sigmoid(proj([h_k ; markov_w1[prev_k]])).
  - markov_w1/w2 rows are parameters only for the target's kept (non-zero lm_head) rows; every other row is exactly
    zero, so a never-seen token keeps logit exactly 0. Cross entropy over the full vocabulary is exact (the zero rows
    enter the softmax as one extra logit log(#zero rows)).

Training (self-distillation; see tools/README.md):
  1. prompts from the demo's data (.train, tools/prepare_demo_data.py): windows of 32..128 tokens of the training
     stream, half of them ending right after an assistant-turn opening (`<｜Assistant｜>` + the next token, as the
     server's generation prompt ends); continued by the frozen target on the device (float32, KV cache) to
     --gen-len new tokens: 75% greedy, 25% sampled at temperature 0.7 for their first 32 new tokens, then greedy.
     Held-out: greedy continuations of windows of the validation streams and of the 64 held-out chat prompts.
  2. one float32 target pass per sequence: the context states h_1, h_3 and the target's greedy token at every
     position (the labels: for greedy text these are the generated tokens themselves).
  3. steps: random sequences, random anchors p in the generated part (p >= prompt length, up to the first EOS);
     loss = sum_k 0.8^k CE(logits_k, y_{p+k+1}) + 0.1 * sum_k BCE(conf_k, 1[argmax logits_k == y_{p+k+1}]) (each
     term averaged over the valid rows of position k; teacher-forced prev_k = the sequence's tokens).
  4. AdamW (betas 0.9/0.95, weight decay 0.1 on matrices except markov_w1), bf16 autocast on CUDA, lr warmup 3% then
     cosine to 10% over the --minutes wall clock; every --eval-every seconds the simulated speculative decoder on the
     held-out greedy text (true inference chain: d_1 = argmax(logits_0 | anchor), d_k with prev = d_{k-1}); the
     weights with the best mean accepted length are exported.
Writes to --out: dspark-draft.xz (the tensors, bf16, unpack_demo_model.py's container), dspark-config.json,
dspark-metrics.json, dspark-reference.safetensors (float64 reference of the exported weights, stored float32, for
the engine's test), dspark-train.log. SIGINT/SIGTERM stop training and still export.
"""
import argparse
import glob
import json
import lzma
import math
import os
import signal
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import demo_model  # noqa: E402
import safetensors_io  # noqa: E402

T_START = time.time()
DSPARK = {"dspark_target_layer_ids": [1, 3], "dspark_block_size": 4, "dspark_markov_rank": 16,
          "dspark_noise_token_id": 128799}
EOS = 1
BOS = 0  # <｜begin▁of▁sentence｜>
ASSISTANT = 128804  # <｜Assistant｜>
CE_DECAY = 0.8      # w_k = 0.8^k
CONF_WEIGHT = 0.1
LOG_LINES = []
STOP = {"now": False}


def log(*args):
    line = "[%7.1fs] %s" % (time.time() - T_START, " ".join(str(a) for a in args))
    print(line, flush=True)
    LOG_LINES.append(line)


def on_signal(signum, frame):
    STOP["now"] = True
    log("signal %d: stopping, exporting" % signum)


# ---- the target ---------------------------------------------------------------------------------------------
def read_target_tensors(path):
    """{name: float32 numpy} of a checkpoint dir (model.safetensors) or of the packed artifact (demo-model.xz.NN)."""
    st = os.path.join(path, "model.safetensors")
    if os.path.exists(st):
        return safetensors_io.read_f32(st), st
    parts = sorted(glob.glob(os.path.join(path, "demo-model.xz.[0-9][0-9]")))
    if not parts:
        # A machine without the unpacked checkpoint (models/ is git-ignored): the packed artifact holds the same
        # bf16 values (tools/unpack_demo_model.py writes them byte for byte).
        assets = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "demo-model")
        parts = sorted(glob.glob(os.path.join(assets, "demo-model.xz.[0-9][0-9]")))
        if not parts or os.path.exists(os.path.join(path, "config.json")):
            raise SystemExit("train_dspark_draft: %s has neither model.safetensors nor demo-model.xz.NN" % path)
        log("%s has no checkpoint: reading the packed %s instead" % (path, assets))
        path = assets
    import unpack_demo_model
    meta, packed = unpack_demo_model.read_container(lzma.decompress(b"".join(open(p, "rb").read() for p in parts)))
    out = {}
    for name, (dtype, shape, data) in packed.items():
        if name.startswith("fp8."):
            continue
        if dtype == "BF16":
            raw = np.frombuffer(unpack_demo_model.unplane(data), dtype="<u2").reshape(shape)
            out[name] = safetensors_io.bf16_to_f32(raw)
        else:
            out[name] = np.frombuffer(data, dtype="<f4").reshape(shape)
    return out, os.path.join(path, "demo-model.xz.NN")


def load_target(path):
    """-> (config, DeepSeekV3 float32 with the checkpoint's (bf16) values, source file)."""
    arrays, source = read_target_tensors(path)
    config = json.load(open(os.path.join(os.path.dirname(source), "config.json")))
    tensors = {k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in arrays.items()
               if (k.startswith("model.") or k == "lm_head.weight") and not k.endswith("_scale_inv")}
    model = demo_model.DeepSeekV3(config)
    model.load_checkpoint_state(tensors)
    return config, model, source


class Target:
    """The frozen target on `device`, float32; compact head over its kept (non-zero) lm_head rows."""

    def __init__(self, model, config, device):
        self.model = model.to(device).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.config = config
        self.device = device
        self.V = config["vocab_size"]
        self.d = config["hidden_size"]
        lm = self.model.lm_head.weight
        nonzero = (lm != 0).any(1)
        self.kept = nonzero.nonzero()[:, 0]
        self.K = int(self.kept.numel())
        self.head = lm[self.kept].contiguous()  # [K, d]
        self.full2c = torch.full((self.V,), -1, dtype=torch.long, device=device)
        self.full2c[self.kept] = torch.arange(self.K, device=device)
        self.first_unkept = int((~nonzero).nonzero()[0, 0])
        self.log_zero = math.log(self.V - self.K)
        self.layer_ids = list(DSPARK["dspark_target_layer_ids"])

    def greedy_full(self, logits_c):
        """Compact logits [..., K] -> the full-vocabulary argmax as a full id (a zero row = logit 0 can win)."""
        best, index = logits_c.max(-1)
        kept_id = self.kept[index]
        unkept = torch.full_like(kept_id, self.first_unkept)
        pick = torch.where(best > 0, kept_id, unkept)
        tie = best == 0
        return torch.where(tie, torch.minimum(kept_id, unkept), pick)

    @torch.no_grad()
    def states(self, ids):
        """ids [B, T] full -> (context states [B, T, S*d] float32, greedy next token [B, T] full ids)."""
        m = self.model
        T = ids.shape[1]
        x = m.embed_tokens(ids)
        cos, sin = m.rope_tables(T, ids.device, torch.float32)
        keep = {}
        for i, layer in enumerate(m.layers):
            x = layer(x, cos, sin)
            if i in self.layer_ids:
                keep[i] = x
        ctx = torch.cat([keep[i] for i in self.layer_ids], dim=-1)
        h = m.norm(x)
        nxt = torch.empty(ids.shape, dtype=torch.long, device=ids.device)
        rows = max(1, int(2e9 // (4 * T * self.K)))  # ~2 GB of float32 logits at a time
        for b in range(0, ids.shape[0], rows):
            nxt[b: b + rows] = self.greedy_full(h[b: b + rows] @ self.head.t())
        return ctx, nxt

    @torch.no_grad()
    def generate(self, prompts, new_tokens, temps, sample_steps, gen):
        """Batched continuation with a KV cache. prompts: lists of full ids (any lengths, left-padded here);
        temps[i] > 0: row i samples its first sample_steps new tokens at that temperature (over the kept rows),
        then greedy. -> list of full sequences (prompt + new_tokens tokens), float32 throughout."""
        m, dev = self.model, self.device
        B = len(prompts)
        lens = [len(p) for p in prompts]
        P = max(lens)
        Tm = P + new_tokens
        ids = torch.zeros(B, Tm, dtype=torch.long, device=dev)
        for i, p in enumerate(prompts):
            ids[i, P - len(p): P] = torch.tensor(p, dtype=torch.long, device=dev)
        pad = torch.tensor([P - n for n in lens], device=dev)
        valid = torch.arange(Tm, device=dev)[None] >= pad[:, None]
        a0 = m.layers[0].self_attn
        dtype = m.embed_tokens.weight.dtype
        caches = [(torch.zeros(B, a0.heads, Tm, a0.nope + a0.rope, device=dev, dtype=dtype),
                   torch.zeros(B, a0.heads, Tm, a0.v, device=dev, dtype=dtype)) for _ in m.layers]
        temps_t = torch.tensor(temps, dtype=torch.float32, device=dev)
        sampled_rows = (temps_t > 0).nonzero()[:, 0]

        def run(start, t):
            x = m.embed_tokens(ids[:, start: start + t])
            pos = (torch.arange(start, start + t, device=dev)[None] - pad[:, None]).clamp(min=0)
            freqs = pos[..., None].to(m.inv_freq.dtype) * m.inv_freq
            cos = (freqs.cos() * m.attention_factor)[:, None]
            sin = (freqs.sin() * m.attention_factor)[:, None]
            kcol = torch.arange(start + t, device=dev)
            qcol = torch.arange(start, start + t, device=dev)
            mask = ((kcol[None, :] <= qcol[:, None])[None] & valid[:, None, : start + t]) | \
                (kcol[None, :] == qcol[:, None])[None]  # a padding row sees itself only
            mask = mask[:, None]
            for layer, cache in zip(m.layers, caches):
                x = x + cached_attention(layer.self_attn, layer.input_layernorm(x), cos, sin, cache, start, mask)
                x = x + layer.mlp(layer.post_attention_layernorm(x))
            return m.norm(x[:, -1])

        h = run(0, P)
        for step in range(new_tokens):
            logits = h @ self.head.t()
            tok = self.greedy_full(logits)
            if step < sample_steps and sampled_rows.numel():
                probs = torch.softmax(logits[sampled_rows] / temps_t[sampled_rows, None], dim=-1)
                tok[sampled_rows] = self.kept[torch.multinomial(probs, 1, generator=gen)[:, 0]]
            ids[:, P + step] = tok
            if step + 1 < new_tokens:
                h = run(P + step, 1)
        ids = ids.cpu()
        return [ids[i, P - lens[i]:].tolist() for i in range(B)]


def cached_attention(a, x, cos, sin, cache, start, mask):
    """demo_model.Attention over x [B, t, d] (normed) at cache columns start..start+t-1 (written), keys 0..start+t-1."""
    B, t, _ = x.shape
    H = a.heads
    if a.q_lora_rank:
        q = a.q_b_proj(a.q_a_layernorm(a.q_a_proj(x)))
    else:
        q = a.q_proj(x)
    q = q.view(B, t, H, a.nope + a.rope).transpose(1, 2)
    kv_a = a.kv_a_proj_with_mqa(x)
    latent, k_rope = kv_a[..., : a.rank], kv_a[..., a.rank:]
    kv = a.kv_b_proj(a.kv_a_layernorm(latent)).view(B, t, H, a.nope + a.v).transpose(1, 2)
    q = torch.cat([q[..., : a.nope], demo_model.apply_rope(q[..., a.nope:], cos, sin)], dim=-1)
    k_rope = demo_model.apply_rope(k_rope.unsqueeze(1), cos, sin).expand(B, H, t, a.rope)
    cache[0][:, :, start: start + t] = torch.cat([kv[..., : a.nope], k_rope], dim=-1)
    cache[1][:, :, start: start + t] = kv[..., a.nope:]
    keys, values = cache[0][:, :, : start + t], cache[1][:, :, : start + t]
    scores = torch.matmul(q, keys.transpose(-1, -2)) * a.scale
    scores = scores.masked_fill(~mask, float("-inf"))
    out = torch.matmul(torch.softmax(demo_model.compute_float(scores), dim=-1).to(values.dtype), values)
    return a.o_proj(out.transpose(1, 2).reshape(B, t, H * a.v))


# ---- the draft ----------------------------------------------------------------------------------------------
class Draft(nn.Module):
    """Trained parameters of the DSpark module; markov_w1/w2 over the target's K kept rows only."""

    def __init__(self, config, K):
        super().__init__()
        d = config["hidden_size"]
        eps = demo_model.config_value(config, "rms_norm_eps", 1e-6)
        S = len(DSPARK["dspark_target_layer_ids"])
        r = DSPARK["dspark_markov_rank"]
        dense = dict(config, n_routed_experts=0)  # every stage a dense SwiGLU MLP of intermediate_size
        self.S, self.G, self.r, self.d, self.K = S, DSPARK["dspark_block_size"], r, d, K
        self.main_proj = nn.Linear(d * S, d, bias=False)
        self.main_norm = demo_model.RMSNorm(d, eps)
        self.stages = nn.ModuleList([demo_model.DecoderLayer(dense, 0) for _ in range(S)])
        self.norm = demo_model.RMSNorm(d, eps)
        self.markov_w1 = nn.Parameter(torch.zeros(K, r))
        self.markov_w2 = nn.Parameter(torch.zeros(K, r))
        self.confidence = nn.Linear(d + r, 1, bias=False)
        self.noise_embedding = nn.Parameter(torch.zeros(d))

    def context(self, states):
        return self.main_norm(self.main_proj(states))

    def block_hidden(self, states, rows, anchors, inv_freq, attention_factor):
        """states [B, T, S*d] target states of positions 0..T-1; rows [B, A, G, d] the block rows' embeddings;
        anchors [B, A] positions p (context = positions < p). -> h [B, A, G, d] after the last norm."""
        B, T, _ = states.shape
        A, G = anchors.shape[1], rows.shape[2]
        dev = states.device
        c = self.context(states)
        pos_c = torch.arange(T, device=dev, dtype=inv_freq.dtype)
        fc = pos_c[:, None] * inv_freq
        cos_c, sin_c = fc.cos() * attention_factor, fc.sin() * attention_factor  # [T, R/2]
        pos_r = (anchors[..., None] + torch.arange(G, device=dev)).reshape(B, A * G).to(inv_freq.dtype)
        fr = pos_r[..., None] * inv_freq
        cos_r, sin_r = (fr.cos() * attention_factor)[:, None], (fr.sin() * attention_factor)[:, None]  # [B,1,AG,R/2]
        ctx_mask = (torch.arange(T, device=dev)[None, None, :] < anchors[..., None])[:, None, :, None, :]  # [B,1,A,1,T]
        own_mask = torch.ones(G, G, dtype=torch.bool, device=dev).tril()  # row k sees rows <= k
        x = rows.reshape(B, A * G, -1)
        for stage in self.stages:
            a = stage.self_attn
            H, C, nope, R, vd = a.heads, a.rank, a.nope, a.rope, a.v
            # injected context entries (no input_layernorm on c)
            kv_c = a.kv_a_proj_with_mqa(c)
            kvb_c = a.kv_b_proj(a.kv_a_layernorm(kv_c[..., :C])).view(B, T, H, nope + vd).transpose(1, 2)
            kr_c = demo_model.apply_rope(kv_c[..., C:].unsqueeze(1), cos_c, sin_c).expand(B, H, T, R)
            key_c = torch.cat([kvb_c[..., :nope], kr_c], dim=-1)  # [B, H, T, qk]
            val_c = kvb_c[..., nope:]
            # the block rows
            xn = stage.input_layernorm(x)
            q = a.q_b_proj(a.q_a_layernorm(a.q_a_proj(xn))) if a.q_lora_rank else a.q_proj(xn)
            q = q.view(B, A * G, H, nope + R).transpose(1, 2)
            q = torch.cat([q[..., :nope], demo_model.apply_rope(q[..., nope:], cos_r, sin_r)], dim=-1)
            kv_r = a.kv_a_proj_with_mqa(xn)
            kvb_r = a.kv_b_proj(a.kv_a_layernorm(kv_r[..., :C])).view(B, A * G, H, nope + vd).transpose(1, 2)
            kr_r = demo_model.apply_rope(kv_r[..., C:].unsqueeze(1), cos_r, sin_r).expand(B, H, A * G, R)
            key_r = torch.cat([kvb_r[..., :nope], kr_r], dim=-1).reshape(B, H, A, G, nope + R)
            val_r = kvb_r[..., nope:].reshape(B, H, A, G, vd)
            q5 = q.reshape(B, H, A, G, nope + R)
            s_c = torch.matmul(q, key_c.transpose(-1, -2)).view(B, H, A, G, T) * a.scale
            s_r = torch.matmul(q5, key_r.transpose(-1, -2)) * a.scale  # [B, H, A, G, G]
            s_c = s_c.masked_fill(~ctx_mask, float("-inf"))
            s_r = s_r.masked_fill(~own_mask, float("-inf"))
            prob = torch.softmax(demo_model.compute_float(torch.cat([s_c, s_r], dim=-1)), dim=-1).to(val_c.dtype)
            out = torch.matmul(prob[..., :T].reshape(B, H, A * G, T), val_c).view(B, H, A, G, vd) + \
                torch.matmul(prob[..., T:], val_r)
            out = a.o_proj(out.reshape(B, H, A * G, vd).transpose(1, 2).reshape(B, A * G, H * vd))
            x = x + out
            x = x + stage.mlp(stage.post_attention_layernorm(x))
        return self.norm(x).view(B, A, G, -1)

    def markov_rows(self, prev_c):
        """compact ids (-1: an unkept token, whose w1 row is zero) -> w1 rows [..., r]."""
        w1 = torch.cat([self.markov_w1, self.markov_w1.new_zeros(1, self.r)], dim=0)
        return w1[torch.where(prev_c < 0, torch.full_like(prev_c, self.K), prev_c)]

    def heads(self, h, prev_c, head):
        """-> compact logits [..., K] (base + Markov), confidence logit [...]."""
        e = self.markov_rows(prev_c)
        logits = torch.matmul(h, head.t()) + torch.matmul(e, self.markov_w2.t())
        conf = self.confidence(torch.cat([h, e.to(h.dtype)], dim=-1))[..., 0]
        return logits, conf


def exact_ce(logits, labels_c, log_zero):
    """Full-vocabulary cross entropy per row: compact logits, labels compact (-1: an unkept token, logit 0)."""
    lf = logits.float()
    lse = torch.logaddexp(torch.logsumexp(lf, dim=-1), torch.full_like(lf[..., 0], log_zero))
    lab = lf.gather(-1, labels_c.clamp(min=0)[..., None])[..., 0]
    return lse - torch.where(labels_c >= 0, lab, torch.zeros_like(lab))


# ---- data -----------------------------------------------------------------------------------------------------
def load_stream(path, kept):
    return kept[np.frombuffer(lzma.decompress(open(path, "rb").read()), dtype="<u2").astype(np.int64)]


def conversation_starts(stream, pmax):
    """(begin, end) of every first turn: from a BOS to just after the first <｜Assistant｜> following it plus the next
    token (a served request's prompt: BOS, user turn, assistant opening), at most 2 * pmax tokens."""
    bos = np.nonzero(stream == BOS)[0]
    assistant = np.nonzero(stream[:-2] == ASSISTANT)[0]
    out = []
    for b in bos:
        i = np.searchsorted(assistant, b)
        if i < len(assistant) and assistant[i] + 2 - b <= 2 * pmax:
            out.append((int(b), int(assistant[i]) + 2))
    return out


def window_prompts(stream, n, rng, pmin, pmax, aligned_share, assistant_pos, starts=None, start_share=0.0):
    out, aligned = [], 0
    for _ in range(n):
        P = int(rng.integers(pmin, pmax + 1))
        if starts and rng.random() < start_share:
            begin, end = starts[int(rng.integers(len(starts)))]
            out.append(stream[begin:end].tolist())
            aligned += 1
            continue
        if assistant_pos is not None and len(assistant_pos) and rng.random() < aligned_share:
            end = int(assistant_pos[rng.integers(len(assistant_pos))]) + 2  # <｜Assistant｜> and the next token
            aligned += 1
            if end - P < 0:
                P = end
        else:
            end = int(rng.integers(P, len(stream) + 1))
        out.append(stream[end - P: end].tolist())
    return out, aligned


class SeqSet:
    """Generated sequences, right-padded: X [N, Tm] full ids, P prompt lengths, E last valid label position (the
    first EOS after the prompt, else the last position), ctx [N, Tm, S*d] target states (bf16 on CUDA), nxt [N, Tm]
    the target's greedy token after each position."""

    def __init__(self, seqs, prompt_lens, target, device, store_dtype, batch, greedy_from=None):
        N = len(seqs)
        Tm = max(len(s) for s in seqs)
        X = torch.zeros(N, Tm, dtype=torch.long)
        E = torch.zeros(N, dtype=torch.long)
        for i, s in enumerate(seqs):
            X[i, : len(s)] = torch.tensor(s)
            gen = s[prompt_lens[i]:]
            E[i] = prompt_lens[i] + gen.index(EOS) if EOS in gen else len(s) - 1
        self.X = X.to(device)
        self.P = torch.tensor(prompt_lens, dtype=torch.long, device=device)
        self.E = E.to(device)
        self.L = torch.tensor([len(s) for s in seqs], dtype=torch.long, device=device)
        S_d = target.d * len(target.layer_ids)
        self.ctx = torch.zeros(N, Tm, S_d, dtype=store_dtype, device=device)
        self.nxt = torch.zeros(N, Tm, dtype=torch.long, device=device)
        for b in range(0, N, batch):
            ctx, nxt = target.states(self.X[b: b + batch])
            self.ctx[b: b + batch] = ctx.to(store_dtype)
            self.nxt[b: b + batch] = nxt
        # agreement of the cached generation with the full pass on the greedy part (a self-check)
        gf = self.P if greedy_from is None else torch.tensor(greedy_from, device=device)
        j = torch.arange(Tm, device=device)[None]
        region = (j >= gf[:, None] + 1) & (j <= self.E[:, None])
        same = (self.nxt[:, :-1] == self.X[:, 1:]) & region[:, 1:]
        self.greedy_agreement = float(same.sum()) / max(int(region[:, 1:].sum()), 1)
        self.N, self.Tm = N, Tm
        self.generated_tokens = int((self.L - self.P).sum())
        self.valid_label_tokens = int((self.E - self.P).clamp(min=0).sum())

    def keep(self, mask):
        for name in ("X", "P", "E", "L", "ctx", "nxt"):
            setattr(self, name, getattr(self, name)[mask])
        self.N = int(self.X.shape[0])


# ---- training / evaluation -------------------------------------------------------------------------------------
def block_inputs(draft, target, data, seq, anchors):
    """-> (states, row embeddings [B,A,G,d], prev tokens [B,A,G] full, labels [B,A,G] full, valid [B,A,G])."""
    G = draft.G
    k = torch.arange(G, device=anchors.device)
    Tc = int(anchors.max())  # context positions < p
    states = data.ctx[seq, : max(Tc, 1)]
    X, nxt = data.X[seq], data.nxt[seq]
    idx = (anchors[..., None] + k).clamp(max=data.Tm - 1)
    B, A = anchors.shape
    prev = X.gather(1, idx.view(B, -1)).view(B, A, G)
    labels = nxt.gather(1, idx.view(B, -1)).view(B, A, G)
    valid = (anchors[..., None] + k + 1) <= data.E[seq][:, None, None]
    emb = target.model.embed_tokens(prev[..., 0])  # the anchor's row
    rows = torch.cat([emb[:, :, None], draft.noise_embedding.to(emb.dtype).expand(B, A, G - 1, emb.shape[-1])], dim=2)
    return states, rows, prev, labels, valid


def train_loss(draft, target, data, seq, anchors):
    states, rows, prev, labels, valid = block_inputs(draft, target, data, seq, anchors)
    h = draft.block_hidden(states.float() if states.dtype != torch.float32 else states, rows, anchors,
                           target.model.inv_freq, target.model.attention_factor)
    logits, conf = draft.heads(h, target.full2c[prev], target.head)
    labels_c = target.full2c[labels]
    ce = exact_ce(logits, labels_c, target.log_zero)
    with torch.no_grad():
        hit = (target.greedy_full(logits.float()) == labels).float()
    bce = F.binary_cross_entropy_with_logits(conf.float(), hit, reduction="none")
    v = valid.float()
    count = v.sum((0, 1)).clamp(min=1)
    ce_k = (ce * v).sum((0, 1)) / count
    bce_k = (bce * v).sum((0, 1)) / count
    w = CE_DECAY ** torch.arange(draft.G, device=ce.device, dtype=torch.float32)
    loss = (w * ce_k).sum() + CONF_WEIGHT * bce_k.sum()
    acc_k = (hit * v).sum((0, 1)) / count
    return loss, ce_k.detach(), bce_k.detach(), acc_k


def eval_anchors(data, seqs, G, stride):
    """All anchors p in [P, E - G] (every gamma label valid) with the stride, padded -> (anchors, mask)."""
    lists = []
    for i in seqs:
        P, E = int(data.P[i]), int(data.E[i])
        lists.append(list(range(P, E - G + 1, stride)))
    A = max(1, max(len(x) for x in lists))
    anchors = torch.zeros(len(seqs), A, dtype=torch.long)
    mask = torch.zeros(len(seqs), A, dtype=torch.bool)
    for r, x in enumerate(lists):
        if x:
            anchors[r, : len(x)] = torch.tensor(x)
            mask[r, : len(x)] = True
        anchors[r, len(x):] = int(data.P[seqs[r]])
    return anchors, mask


@torch.no_grad()
def evaluate(draft, target, data, autocast, stride, chunk, limit=None):
    """Simulated speculative decoding on held-out greedy text: per anchor the true-inference chain d_1..d_G,
    accepted = longest prefix equal to the target's tokens; plus teacher-forced CE and the confidence calibration."""
    G, dev = draft.G, data.X.device
    n = data.N if limit is None else min(limit, data.N)
    acc = {"anchors": 0, "accepted_sum": 0.0, "ge": torch.zeros(G + 1, dtype=torch.float64),
           "conf": torch.zeros(G, dtype=torch.float64), "hit": torch.zeros(G, dtype=torch.float64),
           "cond_hit": torch.zeros(G, dtype=torch.float64), "cond_n": torch.zeros(G, dtype=torch.float64),
           "cond_conf": torch.zeros(G, dtype=torch.float64),
           "tf_ce": torch.zeros(G, dtype=torch.float64), "tf_acc": torch.zeros(G, dtype=torch.float64),
           "bins": torch.zeros(10, 3, dtype=torch.float64)}
    for b in range(0, n, chunk):
        seq = torch.arange(b, min(b + chunk, n), device=dev)
        anchors, amask = eval_anchors(data, seq.tolist(), G, stride)
        anchors, amask = anchors.to(dev), amask.to(dev)
        if not bool(amask.any()):
            continue
        with autocast():
            states, rows, prev, labels, _ = block_inputs(draft, target, data, seq, anchors)
            h = draft.block_hidden(states.float() if states.dtype != torch.float32 else states, rows, anchors,
                                   target.model.inv_freq, target.model.attention_factor)
            base = torch.matmul(h, target.head.t())
        h, base = h.float(), base.float()
        w2 = draft.markov_w2.float()
        # teacher forced (prev = the text's tokens)
        e_tf = draft.markov_rows(target.full2c[prev]).float()
        lt = base + torch.matmul(e_tf, w2.t())
        ce = exact_ce(lt, target.full2c[labels], target.log_zero)
        m = amask[..., None].float()
        acc["tf_ce"] += ((ce * m).sum((0, 1))).double().cpu()
        acc["tf_acc"] += (((target.greedy_full(lt) == labels).float() * m).sum((0, 1))).double().cpu()
        del lt
        # the inference chain
        tok = prev[..., 0]
        alive = amask.clone()
        accepted = torch.zeros_like(anchors)
        for k in range(G):
            e = draft.markov_rows(target.full2c[tok]).float()
            lk = base[:, :, k] + torch.matmul(e, w2.t())
            conf = torch.sigmoid(draft.confidence(torch.cat([h[:, :, k], e], dim=-1).to(
                draft.confidence.weight.dtype))[..., 0].float())
            d = target.greedy_full(lk)
            hit = (d == labels[:, :, k]) & amask
            acc["conf"][k] += float((conf * amask).sum())
            acc["hit"][k] += float(hit.sum())
            acc["cond_n"][k] += float(alive.sum())
            acc["cond_conf"][k] += float((conf * alive).sum())
            alive = alive & hit
            acc["cond_hit"][k] += float(alive.sum())
            accepted += alive.long()
            binned = (conf * 10).long().clamp(max=9)[amask]
            acc["bins"][:, 0] += torch.bincount(binned, minlength=10).double().cpu()
            acc["bins"][:, 1] += torch.bincount(binned, weights=conf[amask].double(), minlength=10).double().cpu()
            acc["bins"][:, 2] += torch.bincount(binned, weights=hit[amask].double(), minlength=10).double().cpu()
            tok = d
        na = int(amask.sum())
        acc["anchors"] += na
        acc["accepted_sum"] += float(accepted[amask].sum())
        for k in range(G + 1):
            acc["ge"][k] += float((accepted[amask] >= k).sum())
    N = max(acc["anchors"], 1)
    bins = acc["bins"]
    return {
        "anchors": acc["anchors"],
        "mean_accepted_length": acc["accepted_sum"] / N,
        "p_accepted_ge_k": [float(acc["ge"][k]) / N for k in range(1, G + 1)],
        "teacher_forced_ce": [float(x) / N for x in acc["tf_ce"]],
        "teacher_forced_accuracy": [float(x) / N for x in acc["tf_acc"]],
        "calibration_per_position": [
            {"position": k + 1, "mean_confidence": float(acc["conf"][k]) / N, "hit_rate": float(acc["hit"][k]) / N,
             "mean_confidence_given_prefix_accepted": float(acc["cond_conf"][k]) / max(float(acc["cond_n"][k]), 1),
             "hit_rate_given_prefix_accepted": float(acc["cond_hit"][k]) / max(float(acc["cond_n"][k]), 1),
             "prefix_accepted_anchors": int(acc["cond_n"][k])} for k in range(G)],
        "calibration_bins": [{"confidence": [i / 10, (i + 1) / 10], "rows": int(bins[i, 0]),
                              "mean_confidence": float(bins[i, 1] / bins[i, 0]) if bins[i, 0] else None,
                              "hit_rate": float(bins[i, 2] / bins[i, 0]) if bins[i, 0] else None} for i in range(10)],
    }


def summary(r):
    return "accepted %.3f, P(>=k) %s, conf %s hit %s" % (
        r["mean_accepted_length"], " ".join("%.3f" % x for x in r["p_accepted_ge_k"]),
        " ".join("%.2f" % c["mean_confidence"] for c in r["calibration_per_position"]),
        " ".join("%.2f" % c["hit_rate"] for c in r["calibration_per_position"]))


# ---- export ---------------------------------------------------------------------------------------------------
def export_state(draft, target):
    """Checkpoint names -> float32 CPU tensors (full vocabulary rows for the Markov head)."""
    out = {}
    S = draft.S
    for s, stage in enumerate(draft.stages):
        for name, t in stage.state_dict().items():
            out["mtp.%d.%s" % (s, name)] = t
    out["mtp.0.main_proj.weight"] = draft.main_proj.weight
    out["mtp.0.main_norm.weight"] = draft.main_norm.weight
    last = "mtp.%d." % (S - 1)
    out[last + "norm.weight"] = draft.norm.weight
    kept = target.kept.cpu()
    for name, w in (("markov_w1", draft.markov_w1), ("markov_w2", draft.markov_w2)):
        full = torch.zeros(target.V, draft.r)
        full[kept] = w.detach().float().cpu()
        out[last + "markov_head.%s.weight" % name] = full
    out[last + "confidence_head.proj.weight"] = draft.confidence.weight
    out["dspark.noise_embedding"] = draft.noise_embedding
    return {k: v.detach().float().cpu().contiguous() for k, v in out.items()}


def pack(state, path):
    """bf16 (round to nearest even) in unpack_demo_model.py's container: BF16 payloads as byte planes, xz.
    -> {name: float32 tensor of the bf16 values}."""
    tensors, rounded = {}, {}
    for name, t in state.items():
        raw = safetensors_io.f32_to_bf16(t.numpy())
        rounded[name] = torch.from_numpy(safetensors_io.bf16_to_f32(raw).copy())
        planes = np.concatenate([(raw >> 8).astype(np.uint8).ravel(), (raw & 0xFF).astype(np.uint8).ravel()])
        tensors[name] = ("BF16", list(t.shape), planes.tobytes())
    container = path + ".container"
    safetensors_io.write(container, tensors, {"layout": "bf16-byte-planes", "module": "dspark-draft"})
    data = open(container, "rb").read()
    os.remove(container)
    packed = lzma.compress(data, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=9)
    open(path, "wb").write(packed)
    return rounded, len(data), len(packed)


@torch.no_grad()
def reference(target_cpu_model, config, rounded, prompts, path):
    """float64 from the exported bf16 weights (target + draft, the NOISE row patched into the embedding)."""
    V, d = config["vocab_size"], config["hidden_size"]
    G, noise = DSPARK["dspark_block_size"], DSPARK["dspark_noise_token_id"]
    model = target_cpu_model.double().eval()
    with torch.no_grad():
        model.embed_tokens.weight[noise] = rounded["dspark.noise_embedding"].double()
    draft = Draft(config, 1).double()
    S = draft.S
    last = "mtp.%d." % (S - 1)
    for s, stage in enumerate(draft.stages):
        stage.load_state_dict({n: rounded["mtp.%d.%s" % (s, n)].double() for n in stage.state_dict()})
    draft.main_proj.weight.copy_(rounded["mtp.0.main_proj.weight"].double())
    draft.main_norm.weight.copy_(rounded["mtp.0.main_norm.weight"].double())
    draft.norm.weight.copy_(rounded[last + "norm.weight"].double())
    draft.confidence.weight.copy_(rounded[last + "confidence_head.proj.weight"].double())
    w1 = rounded[last + "markov_head.markov_w1.weight"].double()
    w2 = rounded[last + "markov_head.markov_w2.weight"].double()
    proj = draft.confidence.weight[0]
    layer_ids = DSPARK["dspark_target_layer_ids"]
    tensors = {}
    for i, prompt in enumerate(prompts):
        ids = torch.tensor(prompt, dtype=torch.long)[None]
        P = ids.shape[1]
        x = model.embed_tokens(ids)
        cos, sin = model.rope_tables(P, ids.device, torch.float64)
        keep = {}
        for li, layer in enumerate(model.layers):
            x = layer(x, cos, sin)
            if li in layer_ids:
                keep[li] = x
        states = torch.cat([keep[li] for li in layer_ids], dim=-1)
        anchor = int(model.lm_head(model.norm(x[:, -1]))[0].argmax())
        rows = model.embed_tokens(torch.tensor([[[anchor] + [noise] * (G - 1)]]))  # [1, 1, G, d]
        anchors = torch.tensor([[P]])
        h = draft.block_hidden(states, rows, anchors, model.inv_freq.double(), model.attention_factor)[0, 0]
        base = model.lm_head(h)  # [G, V]
        drafts, confs = [], []
        prev = anchor
        for k in range(G):
            e = w1[prev]
            logits = base[k] + torch.matmul(w2, e)
            confs.append(float(torch.sigmoid(torch.dot(proj, torch.cat([h[k], e])))))
            prev = int(logits.argmax())
            drafts.append(prev)
        tensors["prompt.%d" % i] = ("I64", [P], np.asarray(prompt, "<i8").tobytes())
        tensors["anchor.%d" % i] = ("I64", [1], np.asarray([anchor], "<i8").tobytes())
        tensors["base_logits.%d" % i] = ("F32", [G, V], base.float().numpy().astype("<f4").tobytes())
        tensors["hidden.%d" % i] = ("F32", [G, d], h.float().numpy().astype("<f4").tobytes())
        tensors["context.%d" % i] = ("F32", [P, d], draft.context(states)[0].float().numpy().astype("<f4").tobytes())
        tensors["drafts.%d" % i] = ("I64", [G], np.asarray(drafts, "<i8").tobytes())
        tensors["confidences.%d" % i] = ("F32", [G], np.asarray(confs, "<f4").tobytes())
        log("reference %d: prompt %d tokens, anchor %d, drafts %s, confidences %s" % (
            i, P, anchor, drafts, " ".join("%.3f" % c for c in confs)))
    safetensors_io.write(path, tensors, {"source": "tools/train_dspark_draft.py: float64 on the CPU (torch %s) from the "
                                         "exported bf16 target and draft weights, NOISE row patched" % torch.__version__})


# ---- main -----------------------------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="models/demo", help="checkpoint dir or the packed assets/demo-model")
    ap.add_argument("--data", default=".train", help="tools/prepare_demo_data.py's output")
    ap.add_argument("--out", required=True)
    ap.add_argument("--minutes", type=float, default=5.0, help="training wall-clock budget (generation not included)")
    ap.add_argument("--gen-seconds", type=float, default=60.0, help="wall-clock budget of the training-text generation")
    ap.add_argument("--max-train-seqs", type=int, default=49152)
    ap.add_argument("--gen-batch", type=int, default=4096, help="sequences per generation batch")
    ap.add_argument("--gen-len", type=int, default=384, help="new tokens per sequence")
    ap.add_argument("--prompt-min", type=int, default=32)
    ap.add_argument("--prompt-max", type=int, default=128)
    ap.add_argument("--aligned-share", type=float, default=0.5, help="prompts ending at an assistant-turn opening")
    ap.add_argument("--start-share", type=float, default=0.35,
                    help="prompts that are a conversation's first turn from its BOS (as served requests start)")
    ap.add_argument("--sample-share", type=float, default=0.25, help="training sequences that sample at first")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--sample-tokens", type=int, default=32, help="new tokens sampled before greedy")
    ap.add_argument("--val-seqs", type=int, default=448, help="held-out windows of the validation streams")
    ap.add_argument("--batch", type=int, default=128, help="sequences per step")
    ap.add_argument("--anchors", type=int, default=32, help="anchors per sequence per step")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--eval-every", type=float, default=30.0)
    ap.add_argument("--init", choices=("target", "random"), default="target",
                    help="stages from the target's layer 0 (dense) and norm from model.norm, or random")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--smoke", action="store_true", help="tiny run on the CPU, to prove the pipeline")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.smoke:
        args.minutes, args.gen_seconds, args.max_train_seqs = min(args.minutes, 0.4), 20.0, 24
        args.gen_batch, args.gen_len, args.prompt_min, args.prompt_max = 12, 40, 16, 40
        args.val_seqs, args.batch, args.anchors, args.eval_every = 6, 4, 8, 10.0
    if device.type == "cuda":  # the target in true float32 (its greedy tokens are the labels); the draft in bf16
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    log("torch %s on %s%s" % (torch.__version__, device,
                              " (%s)" % torch.cuda.get_device_name() if device.type == "cuda" else ""))
    G = DSPARK["dspark_block_size"]
    noise = DSPARK["dspark_noise_token_id"]

    # target
    config, model, target_source = load_target(args.target)
    emb = model.embed_tokens.weight
    if float(emb[noise].detach().abs().max()) != 0.0:
        log("note: the target's embedding row %d is not zero (a checkpoint with a draft merged?); it is not used" % noise)
    target = Target(model, config, device)
    assert int(target.full2c[noise]) < 0, "the NOISE token must have no lm_head row"
    log("target %s: %d layers, hidden %d, %d kept vocabulary rows of %d" % (
        target_source, config["num_hidden_layers"], config["hidden_size"], target.K, target.V))

    # data
    kept_data = np.asarray(json.load(open(os.path.join(args.data, "kept.json"))), dtype=np.int64)
    record = json.load(open(os.path.join(args.data, "record.json")))
    prompts_json = json.load(open(os.path.join(args.data, "prompts.json")))
    if not np.array_equal(kept_data, target.kept.cpu().numpy()):
        log("note: .train/kept.json (%d ids) differs from the target's non-zero head rows (%d)" % (
            len(kept_data), target.K))
    train_stream = load_stream(os.path.join(args.data, "train.tokens.xz"), kept_data)
    val_stream = np.concatenate([load_stream(os.path.join(args.data, "val_chat.tokens.xz"), kept_data),
                                 load_stream(os.path.join(args.data, "val_plain.tokens.xz"), kept_data)])
    chat_prompts = prompts_json["held_out_chat_prompts"]
    if args.smoke:
        chat_prompts = chat_prompts[:2]
    log("data %s: train stream %d tokens, validation %d, %d held-out chat prompts" % (
        args.data, len(train_stream), len(val_stream), len(chat_prompts)))
    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed)

    # held-out text: greedy continuations of validation windows and of the held-out chat prompts
    t0 = time.time()
    val_prompts, _ = window_prompts(val_stream, args.val_seqs, rng, args.prompt_min, args.prompt_max, 0.0, None)
    held_prompts = val_prompts + chat_prompts
    held = []
    for b in range(0, len(held_prompts), args.gen_batch):
        part = held_prompts[b: b + args.gen_batch]
        held += target.generate(part, args.gen_len, [0.0] * len(part), 0, gen)
    eval_gen_seconds = time.time() - t0
    log("held-out generation: %d sequences (%d validation windows, %d chat prompts) in %.1fs" % (
        len(held), len(val_prompts), len(chat_prompts), eval_gen_seconds))

    # training text
    t0 = time.time()
    assistant_pos = np.nonzero(train_stream[:-2] == ASSISTANT)[0]
    starts = conversation_starts(train_stream, args.prompt_max)
    log("conversation starts (BOS .. first assistant opening): %d" % len(starts))
    train_seqs, train_plens, greedy_from = [], [], []
    aligned_total = sampled_total = 0
    while len(train_seqs) < args.max_train_seqs and not STOP["now"]:
        if train_seqs and time.time() - t0 > args.gen_seconds:
            break
        n = min(args.gen_batch, args.max_train_seqs - len(train_seqs))
        prompts, aligned = window_prompts(train_stream, n, rng, args.prompt_min, args.prompt_max, args.aligned_share,
                                          assistant_pos, starts, args.start_share)
        temps = [args.temperature if rng.random() < args.sample_share else 0.0 for _ in prompts]
        seqs = target.generate(prompts, args.gen_len, temps, args.sample_tokens, gen)
        train_seqs += seqs
        train_plens += [len(p) for p in prompts]
        greedy_from += [len(p) + (args.sample_tokens if t > 0 else 0) for p, t in zip(prompts, temps)]
        aligned_total += aligned
        sampled_total += sum(1 for t in temps if t > 0)
    train_gen_seconds = time.time() - t0
    log("training generation: %d sequences (%d turn-aligned prompts, %d sampled first) in %.1fs" % (
        len(train_seqs), aligned_total, sampled_total, train_gen_seconds))

    t0 = time.time()
    store = torch.bfloat16 if device.type == "cuda" else torch.float32
    state_batch = 64 if device.type == "cuda" else 8
    train = SeqSet(train_seqs, train_plens, target, device, store, state_batch, greedy_from)
    evalset = SeqSet(held, [len(p) for p in held_prompts], target, device, store, state_batch)
    chat_from = len(val_prompts)
    usable = train.E - train.P >= 1
    dropped = int((~usable).sum())
    train.keep(usable)
    states_seconds = time.time() - t0
    log("target states: %.1fs; greedy agreement generation/full pass %.5f (train, greedy part) %.5f (held-out); "
        "%d training sequences dropped (EOS first)" % (states_seconds, train.greedy_agreement,
                                                       evalset.greedy_agreement, dropped))
    log("training sequences %d: %d prompt + %d generated tokens, %d labels before EOS" % (
        train.N, int(train.P.sum()), train.generated_tokens, train.valid_label_tokens))

    class Sub:  # a view of evalset's rows
        def __init__(self, base, rows):
            for name in ("X", "P", "E", "ctx", "nxt"):
                setattr(self, name, getattr(base, name)[rows])
            self.N, self.Tm = len(rows), base.Tm

    eval_val = Sub(evalset, torch.arange(0, chat_from, device=device))
    eval_chat = Sub(evalset, torch.arange(chat_from, evalset.N, device=device))

    # draft
    draft = Draft(config, target.K)
    with torch.no_grad():
        std = 0.02
        for name, p in draft.named_parameters():
            if "norm" in name:
                torch.nn.init.ones_(p)
            else:
                torch.nn.init.normal_(p, 0.0, std)
        d = config["hidden_size"]
        S = draft.S
        draft.main_proj.weight.add_(torch.cat([torch.eye(d) / S] * S, dim=1))
        if args.init == "target":
            for stage in draft.stages:
                stage.load_state_dict(model.layers[0].state_dict())
            draft.norm.weight.copy_(model.norm.weight.cpu())
        draft.markov_w1.normal_(0.0, 0.1)
        draft.markov_w2.zero_()
        draft.confidence.weight.zero_()
        kept_cpu = target.kept.cpu()
        row_norm = model.embed_tokens.weight.detach().cpu()[kept_cpu].norm(dim=1).mean()
        draft.noise_embedding.copy_(torch.randn(d) * row_norm / math.sqrt(d))
    draft.to(device)
    n_params = sum(p.numel() for p in draft.parameters())
    log("draft: %d trained parameters (%d in the checkpoint layout)" % (
        n_params, n_params + 2 * (target.V - target.K) * draft.r))

    no_decay_names = ("markov_w1", "noise_embedding")
    decay = [p for n, p in draft.named_parameters() if p.dim() == 2 and not n.startswith(no_decay_names)]
    no_decay = [p for n, p in draft.named_parameters() if not (p.dim() == 2 and not n.startswith(no_decay_names))]
    fused = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, **fused)

    def autocast():
        if device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return torch.autocast("cpu", enabled=False)

    eval_chunk = 16 if device.type == "cuda" else 4
    eval_stride = 3 if device.type == "cuda" else 4
    budget = args.minutes * 60.0
    t_train = time.time()
    deadline = t_train + budget
    warmup = 0.03 * budget
    step = rows_seen = 0
    best = {"score": -1.0, "state": None, "step": 0}
    history, curve = [], []
    next_eval = t_train + args.eval_every
    run_ce = None

    def check():
        draft.eval()
        r = evaluate(draft, target, eval_val, autocast, eval_stride * 2, eval_chunk, limit=None if args.smoke else 192)
        rc = evaluate(draft, target, eval_chat, autocast, eval_stride * 2, eval_chunk)
        draft.train()
        total = r["anchors"] + rc["anchors"]
        score = (r["mean_accepted_length"] * r["anchors"] + rc["mean_accepted_length"] * rc["anchors"]) / max(total, 1)
        history.append({"step": step, "seconds": round(time.time() - t_train, 1), "mean_accepted_length": score,
                        "validation_windows": r["mean_accepted_length"], "chat": rc["mean_accepted_length"],
                        "teacher_forced_ce": r["teacher_forced_ce"]})
        if score > best["score"]:
            best.update(score=score, step=step,
                        state={k: v.detach().clone() for k, v in draft.state_dict().items()})
        log("step %d: held-out accepted length %.3f (validation windows %.3f, chat %.3f; best %.3f at step %d); "
            "tf CE %s" % (step, score, r["mean_accepted_length"], rc["mean_accepted_length"], best["score"],
                          best["step"], " ".join("%.3f" % x for x in r["teacher_forced_ce"])))

    draft.train()
    while not STOP["now"]:
        now = time.time()
        if now >= deadline:
            break
        elapsed = now - t_train
        lr = args.lr * (elapsed / warmup if elapsed < warmup else
                        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (elapsed - warmup) / (budget - warmup))))
        for g in opt.param_groups:
            g["lr"] = lr
        seq = torch.randint(0, train.N, (args.batch,), device=device, generator=gen)
        P, E = train.P[seq], train.E[seq]
        u = torch.rand(args.batch, args.anchors, device=device, generator=gen)
        anchors = torch.minimum(P[:, None] + (u * (E - P)[:, None].float()).long(), (E - 1)[:, None])
        with autocast():
            loss, ce_k, bce_k, acc_k = train_loss(draft, target, train, seq, anchors)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        step += 1
        rows_seen += args.batch * args.anchors * G
        if step % 100 == 0 or (args.smoke and step % 5 == 0):
            el = time.time() - t_train
            ce_list = [round(float(x), 4) for x in ce_k]
            curve.append({"step": step, "seconds": round(el, 1), "lr": lr, "loss": round(loss.item(), 4),
                          "ce_per_position": ce_list, "bce_per_position": [round(float(x), 4) for x in bce_k],
                          "teacher_forced_hit_per_position": [round(float(x), 4) for x in acc_k]})
            log("step %d lr %.2e loss %.4f ce %s hit %s (%.0f rows/s)" % (
                step, lr, loss.item(), " ".join("%.3f" % x for x in ce_list),
                " ".join("%.3f" % float(x) for x in acc_k), rows_seen / el))
        if time.time() >= next_eval:
            check()
            next_eval = time.time() + args.eval_every
    train_seconds = time.time() - t_train
    log("training stopped after %d steps (%d block rows), %.0fs" % (step, rows_seen, train_seconds))
    check()
    draft.load_state_dict(best["state"])
    draft.eval()

    # export first
    t0 = time.time()
    state = export_state(draft, target)
    rounded, container_bytes, packed_bytes = pack(state, os.path.join(args.out, "dspark-draft.xz"))
    json.dump(DSPARK, open(os.path.join(args.out, "dspark-config.json"), "w"), indent=2)
    log("exported %d tensors: %.1f MB -> %.2f MB xz" % (len(state), container_bytes / 1e6, packed_bytes / 1e6))
    export_seconds = time.time() - t0

    # final evaluation in float32 with the exported (bf16-rounded) weights
    t0 = time.time()
    with torch.no_grad():
        last = "mtp.%d." % (draft.S - 1)
        kept_cpu = target.kept.cpu()
        own = {}
        for s in range(draft.S):
            for n in draft.stages[s].state_dict():
                own["stages.%d.%s" % (s, n)] = rounded["mtp.%d.%s" % (s, n)]
        own.update({"main_proj.weight": rounded["mtp.0.main_proj.weight"],
                    "main_norm.weight": rounded["mtp.0.main_norm.weight"],
                    "norm.weight": rounded[last + "norm.weight"],
                    "markov_w1": rounded[last + "markov_head.markov_w1.weight"][kept_cpu],
                    "markov_w2": rounded[last + "markov_head.markov_w2.weight"][kept_cpu],
                    "confidence.weight": rounded[last + "confidence_head.proj.weight"],
                    "noise_embedding": rounded["dspark.noise_embedding"]})
        draft.load_state_dict({k: v.to(device) for k, v in own.items()})
    draft.float()
    identity = lambda: torch.autocast(device.type, enabled=False)  # noqa: E731
    final_val = evaluate(draft, target, eval_val, identity, 1, eval_chunk)
    final_chat = evaluate(draft, target, eval_chat, identity, 1, eval_chunk)
    eval_seconds = time.time() - t0
    log("final (float32, exported weights) validation windows: %s" % summary(final_val))
    log("final (float32, exported weights) held-out chat:      %s" % summary(final_chat))

    # reference
    t0 = time.time()
    refs = prompts_json["reference_prompts"]
    ref_prompts = [refs[-1][:5], refs[1], refs[3][:70]]  # plain text; a whole chat prompt; a long context
    _, cpu_model, _ = load_target(args.target)
    reference(cpu_model, config, rounded, ref_prompts, os.path.join(args.out, "dspark-reference.safetensors"))
    reference_seconds = time.time() - t0

    metrics = {
        "dspark_config": DSPARK,
        "target": {"source": target_source, "kept_vocabulary_rows": target.K, "vocab_size": target.V},
        "draft": {"stages": draft.S, "block_size": G, "markov_rank": draft.r, "trained_parameters": n_params,
                  "init": args.init + (" (stages from target layer 0, norm from model.norm, main_proj [I/S ...] + "
                                       "N(0, 0.02), markov_w2 0, confidence 0)" if args.init == "target" else "")},
        "data": {
            "source": os.path.abspath(args.data) + " (tools/prepare_demo_data.py; record below)",
            "record": record,
            "train_stream_tokens": int(len(train_stream)), "validation_stream_tokens": int(len(val_stream)),
            "training_sequences": train.N, "training_prompt_tokens": int(train.P.sum()),
            "training_generated_tokens": train.generated_tokens, "training_labels_before_eos": train.valid_label_tokens,
            "training_sequences_dropped_eos_first": dropped,
            "held_out_sequences": {"validation_windows": eval_val.N, "chat_prompts": eval_chat.N},
            "held_out_generated_tokens": evalset.generated_tokens,
        },
        "generation": {
            "prompts": "windows of %d..%d tokens of the training stream, %.0f%% ending right after an assistant-turn "
                       "opening (<｜Assistant｜> + next token), else at random offsets" % (
                           args.prompt_min, args.prompt_max, 100 * args.aligned_share),
            "new_tokens": args.gen_len,
            "sampling": "%.0f%% of training sequences sample their first %d new tokens at temperature %.2f (over the "
                        "kept rows), then greedy; all others and all held-out greedy; float32 target with a KV cache" % (
                            100 * args.sample_share, args.sample_tokens, args.temperature),
            "labels": "the target's greedy token after each position from one float32 full pass (= the generated "
                      "token on greedy text)",
            "greedy_agreement_generation_vs_full_pass": {"train": train.greedy_agreement,
                                                          "held_out": evalset.greedy_agreement},
            "conversation_start_share": args.start_share, "turn_aligned_prompts": aligned_total, "sampled_sequences": sampled_total,
        },
        "training": {"steps": step, "block_rows": rows_seen, "seconds": round(train_seconds, 1),
                     "sequences_per_step": args.batch, "anchors_per_sequence": args.anchors,
                     "anchors": "uniform in [prompt length, first EOS - 1] (the generated part); rows past the EOS "
                                "masked",
                     "loss": "sum_k %.1f^k CE_k + %.1f sum_k BCE_k (per-position means over valid rows)" % (
                         CE_DECAY, CONF_WEIGHT),
                     "lr_peak": args.lr, "schedule": "3% warmup, cosine to 10% over the wall clock",
                     "best_step": best["step"], "best_held_out_accepted_length": best["score"],
                     "curve": curve, "evaluations": history},
        "evaluation": {
            "method": "simulated greedy speculative decoding on held-out greedy generations, every anchor p in the "
                      "generated part with all %d labels before EOS: d_1 = argmax(base_0 + markov(anchor)), d_k = "
                      "argmax(base_{k-1} + markov(d_{k-1})); accepted = longest prefix equal to the target's tokens; "
                      "float32, exported bf16 weights" % G,
            "validation_windows": final_val, "held_out_chat": final_chat,
        },
        "artifact": {"file": "dspark-draft.xz", "tensors": len(state), "container_bytes": container_bytes,
                     "packed_bytes": packed_bytes},
        "reference": {"prompt_lengths": [len(p) for p in ref_prompts],
                      "prompts": "prompts.json reference_prompts (tools/prepare_demo_data.py REFERENCE_CHATS / "
                                 "REFERENCE_TEXT): the plain text's first 5 tokens; the second chat ('What does "
                                 "open do?', thinking, generation prompt open) whole; the fourth chat's (tools) first "
                                 "70 tokens"},
        "wall_seconds": {"total": round(time.time() - T_START, 1), "held_out_generation": round(eval_gen_seconds, 1),
                         "training_generation": round(train_gen_seconds, 1), "target_states": round(states_seconds, 1),
                         "train": round(train_seconds, 1), "export": round(export_seconds, 1),
                         "final_eval": round(eval_seconds, 1), "reference": round(reference_seconds, 1)},
        "peak_gpu_memory_gb": round(torch.cuda.max_memory_allocated() / 1e9, 1) if device.type == "cuda" else None,
        "torch": torch.__version__,
        "device": str(device) + (" (%s)" % torch.cuda.get_device_name() if device.type == "cuda" else ""),
        "smoke": bool(args.smoke),
    }
    json.dump(metrics, open(os.path.join(args.out, "dspark-metrics.json"), "w"), indent=1)
    if device.type == "cuda":
        log("peak GPU memory %.1f GB" % (torch.cuda.max_memory_allocated() / 1e9))
    log("done in %.1fs" % (time.time() - T_START))
    open(os.path.join(args.out, "dspark-train.log"), "w").write("\n".join(LOG_LINES) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
