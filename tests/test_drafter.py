"""The drafter's math against independent computations written plainly here (float32, CPU)."""
import itertools
import math

import pytest
import torch

from sglang_dspine.drafter.config import DrafterConfig
from sglang_dspine.drafter.decoding import decode_block, walk
from sglang_dspine.drafter.model import DSpineDrafter
from sglang_dspine.drafter.tiny import drafter_config_for

pytestmark = pytest.mark.usefixtures("no_grad")  # conftest.py



# ----------------------------------------------------------------------------- plain reference
def ref_norm(x, w, eps=1e-6):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def ref_rope(x, pos, theta):
    # x: [T, heads, d]; rotate pairs (j, j + d/2) by pos * theta^(-2j/d)
    d = x.shape[-1]
    out = x.clone()
    for t in range(x.shape[0]):
        for j in range(d // 2):
            ang = float(pos[t]) * theta ** (-2 * j / d)
            c, s = math.cos(ang), math.sin(ang)
            a, b = x[t, :, j], x[t, :, j + d // 2]
            out[t, :, j], out[t, :, j + d // 2] = a * c - b * s, b * c + a * s
    return out


def ref_unit(v):
    return v / v.norm()


def ref_forward(drafter, feats, emb, s, anchor, inject=True):
    """One block at anchor position s over context feats [S, n·H]; loops over positions and heads."""
    cfg, P = drafter.cfg, dict(drafter.state_dict())
    B, H, d = cfg.block_size, cfg.hidden_size, cfg.head_dim
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    ctx = ref_norm(feats @ P["fc.weight"].T, P["hidden_norm.weight"])
    S = ctx.shape[0]
    x = emb.clone()
    pre = None
    for l in range(cfg.num_hidden_layers):
        p = lambda n: P[f"layers.{l}.{n}"]
        xn = ref_norm(x, p("input_layernorm.weight"))
        q = ref_rope(ref_norm((xn @ p("self_attn.q_proj.weight").T).view(B, nh, d), p("self_attn.q_norm.weight")),
                     list(range(s, s + B)), cfg.rope_theta)
        keys_in = torch.cat([ctx, xn])
        k = (keys_in @ p("self_attn.k_proj.weight").T).view(S + B, nkv, d)
        k = ref_rope(ref_norm(k, p("self_attn.k_norm.weight")), list(range(S)) + list(range(s, s + B)), cfg.rope_theta)
        v = (keys_in @ p("self_attn.v_proj.weight").T).view(S + B, nkv, d)
        att = torch.zeros(B, nh, d)
        for i in range(B):
            for h in range(nh):
                g = h // (nh // nkv)
                allowed = list(range(S)) + [S + j for j in range(B) if (j <= i or not cfg.is_causal)]
                logits = torch.stack([q[i, h] @ k[t, g] / math.sqrt(d) for t in allowed])
                w = torch.softmax(logits, 0)
                att[i, h] = sum(w[n] * v[t, g] for n, t in enumerate(allowed))
        x = x + att.reshape(B, nh * d) @ p("self_attn.o_proj.weight").T
        xn = ref_norm(x, p("post_attention_layernorm.weight"))
        mlp = (torch.nn.functional.silu(xn @ p("mlp.gate_proj.weight").T) * (xn @ p("mlp.up_proj.weight").T))
        x = x + mlp @ p("mlp.down_proj.weight").T
        pre = x.clone()
        if inject:
            r = cfg.dspine.transfer_rank
            R, U = P[f"injection.readouts.{l}.weight"], P[f"injection.writes.{l}.weight"]
            for i in range(1, B):
                f_i = math.sqrt(r) * ref_unit(R @ pre[i])
                if i == 1:
                    p_i = math.sqrt(r) * P["transfer_codes"][anchor]
                else:
                    p_i = math.sqrt(r) * ref_unit(R @ pre[i - 1])
                gate = torch.sigmoid(P["injection.receiver_gate.weight"] @ f_i + P["injection.predecessor_gate.weight"] @ p_i
                                     + P["injection.bias"])
                x[i] = pre[i] + pre[i].norm() / math.sqrt(H) * (U @ (gate * (P["injection.message.weight"] @ p_i)))
    return ref_norm(x, P["norm.weight"]), pre


def ref_refine(drafter, h, a):
    P, cfg = drafter.state_dict(), drafter.cfg
    r, L = cfg.dspine.transfer_rank, cfg.num_hidden_layers
    f = math.sqrt(r) * ref_unit(P[f"injection.readouts.{L - 1}.weight"] @ h)
    p = math.sqrt(r) * P["transfer_codes"][a]
    gate = torch.sigmoid(P["injection.receiver_gate.weight"] @ f + P["injection.predecessor_gate.weight"] @ p + P["injection.bias"])
    out = h + h.norm() / math.sqrt(cfg.hidden_size) * (P[f"injection.writes.{L - 1}.weight"] @ (gate * (P["injection.message.weight"] @ p)))
    return ref_norm(out, P["norm.weight"])


# ------------------------------------------------------------------------------------- helpers
def run_block(drafter, target, feats, s, anchor):
    b = drafter.cfg.block_size
    kv = drafter.context_kv(feats[None], torch.arange(feats.shape[0])[None])
    ids = torch.tensor([[anchor] + [drafter.cfg.mask_token_id] * (b - 1)])
    emb = target.get_input_embeddings()(ids).view(1, 1, b, -1)
    out = drafter.forward_blocks(emb, (s + torch.arange(b)).view(1, 1, b), kv,
                                 torch.ones(1, 1, feats.shape[0], dtype=torch.bool), torch.tensor([[anchor]]))
    return out, emb[0, 0]


def context(drafter, s, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(s, len(drafter.cfg.target_layer_ids) * drafter.cfg.hidden_size, generator=g)


# --------------------------------------------------------------------------------------- tests
def test_block_forward_matches_plain_reference(dspine, target):
    feats, s, anchor = context(dspine, 7), 7, 5
    out, emb = run_block(dspine, target, feats, s, anchor)
    ref_hidden, ref_pre = ref_forward(dspine, feats, emb, s, anchor)
    torch.testing.assert_close(out.hidden[0, 0], ref_hidden, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out.pre_last[0, 0], ref_pre, atol=2e-5, rtol=2e-5)
    # the injection changed something, so the comparison above really covers it
    plain, _ = ref_forward(dspine, feats, emb, s, anchor, inject=False)
    assert (plain[1:] - ref_hidden[1:]).abs().max() > 1e-3
    assert torch.equal(plain[0], ref_hidden[0]) or torch.allclose(plain[0], ref_hidden[0], atol=1e-6)


def test_bidirectional_dflash_block_matches_reference(target):
    torch.manual_seed(4)
    d = DSpineDrafter(drafter_config_for(target, kind="dflash")).eval()
    assert not d.cfg.is_causal
    feats = context(d, 6)
    out, emb = run_block(d, target, feats, 6, 9)
    ref_hidden, _ = ref_forward(d, feats, emb, 6, 9, inject=False)
    torch.testing.assert_close(out.hidden[0, 0], ref_hidden, atol=2e-5, rtol=2e-5)


def test_zero_injection_is_exactly_the_dflash_backbone(target):
    torch.manual_seed(2)
    cfg = drafter_config_for(target)
    fresh = DSpineDrafter(cfg).eval()  # writes, predecessor gate and bias are zero-initialised
    from sglang_dspine.drafter.checkpoint import init_dspine_transfer
    init_dspine_transfer(fresh, target.lm_head.weight)
    dflash_cfg = DrafterConfig.from_dict({**cfg.to_dict(), "architectures": ["DFlashDraftModel"], "is_causal": True})
    backbone = DSpineDrafter(dflash_cfg).eval()
    backbone.load_state_dict({k: v for k, v in fresh.state_dict().items() if not k.startswith(("injection", "transfer"))})
    feats = context(fresh, 9)
    a, _ = run_block(fresh, target, feats, 9, 3)
    b, _ = run_block(backbone, target, feats, 9, 3)
    assert torch.equal(a.hidden, b.hidden)
    head = target.lm_head.weight
    assert torch.equal(a.hidden @ head.T, b.hidden @ head.T)


def test_backbone_without_context_is_a_qwen3_stack(target):
    """With no context, the causal backbone is a plain Qwen3 decoder stack: check against transformers."""
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(5)
    cfg = drafter_config_for(target, kind="dflash")
    d = DSpineDrafter(DrafterConfig.from_dict({**cfg.to_dict(), "is_causal": True})).eval()
    t = target.config
    q = Qwen3Model(Qwen3Config(vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
                               num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=t.num_attention_heads,
                               num_key_value_heads=t.num_key_value_heads, head_dim=t.head_dim, rope_theta=cfg.rope_theta,
                               rms_norm_eps=cfg.rms_norm_eps)).float().eval()
    missing = q.load_state_dict({k: v for k, v in d.state_dict().items() if k.startswith(("layers.", "norm."))}, strict=False)
    assert set(missing.missing_keys) == {"embed_tokens.weight"}
    b, s = cfg.block_size, 11
    emb = torch.randn(1, b, cfg.hidden_size)
    ref = q(inputs_embeds=emb, position_ids=(s + torch.arange(b))[None]).last_hidden_state
    empty = d.context_kv(torch.zeros(1, 0, len(cfg.target_layer_ids) * cfg.hidden_size), torch.zeros(1, 0, dtype=torch.long))
    out = d.forward_blocks(emb.view(1, 1, b, -1), (s + torch.arange(b)).view(1, 1, b), empty,
                           torch.zeros(1, 1, 0, dtype=torch.bool), torch.tensor([[0]]))
    torch.testing.assert_close(out.hidden[0, 0], ref[0], atol=2e-5, rtol=2e-5)


def test_many_blocks_equal_single_blocks(dspine, target):
    """The training layout (several blocks per sequence, each masked to its own context) equals one block at a time."""
    S, b = 12, dspine.cfg.block_size
    feats = context(dspine, S)
    anchors_pos, anchors_tok = [3, 7, 10], [4, 8, 2]
    kv = dspine.context_kv(feats[None], torch.arange(S)[None])
    ids = torch.tensor([[t] + [dspine.cfg.mask_token_id] * (b - 1) for t in anchors_tok])
    emb = target.get_input_embeddings()(ids).view(1, 3, b, -1)
    pos = torch.tensor(anchors_pos).view(1, 3, 1) + torch.arange(b).view(1, 1, b)
    visible = (torch.arange(S).view(1, 1, S) < torch.tensor(anchors_pos).view(1, 3, 1))
    many = dspine.forward_blocks(emb, pos, kv, visible, torch.tensor([anchors_tok]))
    for n, (p, t) in enumerate(zip(anchors_pos, anchors_tok)):
        one, _ = run_block(dspine, target, feats[:p], p, t)
        torch.testing.assert_close(many.hidden[0, n], one.hidden[0, 0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(many.pre_last[0, n], one.pre_last[0, 0], atol=1e-5, rtol=1e-5)


def test_prefix_does_not_see_the_future(dspine, target):
    """Causal inside the block: position i's output does not change when later block inputs change."""
    feats = context(dspine, 5)
    out, emb = run_block(dspine, target, feats, 5, 1)
    kv = dspine.context_kv(feats[None], torch.arange(5)[None])
    b = dspine.cfg.block_size
    emb2 = emb.clone()
    emb2[2:] = torch.randn_like(emb2[2:])
    out2 = dspine.forward_blocks(emb2.view(1, 1, b, -1), (5 + torch.arange(b)).view(1, 1, b), kv,
                                 torch.ones(1, 1, 5, dtype=torch.bool), torch.tensor([[1]]))
    torch.testing.assert_close(out.hidden[0, 0, :2], out2.hidden[0, 0, :2], atol=1e-6, rtol=1e-6)
    assert (out.hidden[0, 0, 2:] - out2.hidden[0, 0, 2:]).abs().max() > 1e-3


def test_transition_table_matches_pairwise_refinement(dspine, target):
    feats, s, anchor = context(dspine, 6), 6, 7
    out, _ = run_block(dspine, target, feats, s, anchor)
    head = target.lm_head.weight
    draft = dspine.draft(out, head, torch.tensor([anchor]))
    K, P = dspine.cfg.dspine.top_k, dspine.cfg.block_size - 1
    logits = out.hidden[0, 0, 1:] @ head.T
    assert torch.equal(draft.candidates[0], logits.topk(K).indices)
    for i in range(P):
        for k in range(K):
            a = anchor if i == 0 else int(draft.candidates[0, i - 1, k])
            refined = ref_refine(dspine, out.pre_last[0, 0, i + 1], a)
            for j in range(K):
                want = refined @ head[draft.candidates[0, i, j]]
                torch.testing.assert_close(draft.scores[0, i, k, j], want, atol=1e-4, rtol=1e-5)
    # the refinement makes rows differ, so the walk really depends on the previous pick
    assert (draft.scores[0, 1:] - draft.scores[0, 1:, :1]).abs().max() > 1e-4


@pytest.mark.parametrize("K,P", [(2, 2), (3, 3), (3, 4), (4, 3)])
def test_walk_equals_brute_force_over_chains(K, P):
    """Among all K^P chains exactly one follows 'best in the row of the previous pick' at every step:
    the walk returns it."""
    g = torch.Generator().manual_seed(K * 10 + P)
    for _ in range(20):
        scores = torch.randn(1, P, K, K, generator=g)
        consistent = []
        for chain in itertools.product(range(K), repeat=P):
            prev, ok = 0, True
            for i, j in enumerate(chain):
                row = scores[0, i, prev]
                if int(row.argmax()) != j:
                    ok = False
                    break
                prev = j
            if ok:
                consistent.append(list(chain))
        assert len(consistent) == 1
        assert walk(scores)[0].tolist() == consistent[0]


def test_decode_block_batches_independently(dspine, target):
    """Two requests decoded together give what each gives alone."""
    head = target.lm_head.weight
    outs = [run_block(dspine, target, context(dspine, s, seed=s), s, a)[0] for s, a in [(4, 1), (8, 6)]]
    anchors = torch.tensor([1, 6])
    logits = torch.cat([o.hidden[:, 0, 1:] for o in outs]) @ head.T
    pre = torch.cat([o.pre_last[:, 0, 1:] for o in outs])
    both = decode_block(logits, pre, anchors, dspine.cfg.dspine.top_k, dspine.refine_normed, dspine.transfer_codes, head)
    for n, o in enumerate(outs):
        alone = dspine.draft(o, head, anchors[n : n + 1])
        assert torch.equal(both.tokens[n], alone.tokens[0])
        torch.testing.assert_close(both.scores[n], alone.scores[0])
