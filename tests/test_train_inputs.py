"""What `train` is given and what it makes of it: defaults fitted to the target, errors that name the flag,
SpecForge conversation data (chat templates, loss on assistant turns), the mask token, TensorBoard logs and
resume state that cannot run code."""
import json
import os
import shutil

import pytest
import torch

from sglang_dspine.cli import main as cli_main
from sglang_dspine.drafter.config import DrafterConfigError, fit_target_layer_ids, fresh_settings
from sglang_dspine.drafter.tiny import make_target
from sglang_dspine.training.chat import ChatFormat, resolve_template, tokenize_conversation
from sglang_dspine.training.data import iter_token_data, prompt_ids
from sglang_dspine.training.drafter_setup import default_mask_token, default_num_draft_layers
from sglang_dspine.training.jsonl import DataError, read_jsonl
from sglang_dspine.training.train_config import TrainConfig
from sglang_dspine.training.trainer import load_trainer_state, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TARGET = os.path.join(ROOT, "models", "default", "target")

SPECIALS = ["[UNK]", "<im_start>", "<im_end>", "<think>", "</think>", "user", "assistant", "system"]
WORDS = [f"w{i}" for i in range(55)]
# A template in the manner of Qwen3's: a think block only in the last assistant turn.
THINK_LAST = ("{% for m in messages %}{% if m.role == 'assistant' and loop.last %}"
              "{{ '<im_start> assistant <think> </think> ' + m.content + ' <im_end> ' }}"
              "{% else %}{{ '<im_start> ' + m.role + ' ' + m.content + ' <im_end> ' }}{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<im_start> assistant ' }}{% endif %}")


pytestmark = pytest.mark.usefixtures("one_thread")


def word_tokenizer(template=THINK_LAST, extra=(), mask_token=None, path=None):
    """A word-level fast tokenizer over SPECIALS + w0..w54 (+ extra tokens) with an optional chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS + list(extra))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    kw = {"chat_template": template} if template else {}
    if mask_token:
        kw["mask_token"] = mask_token
    t = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<im_end>", **kw)
    if path:
        t.save_pretrained(path)
    return t


def chat(seed, turns=2, style="role"):
    """A conversation of `turns` user/assistant pairs of random words, role/content or from/value."""
    g = torch.Generator().manual_seed(seed)
    words = lambda n: " ".join(f"w{int(i)}" for i in torch.randint(0, 55, (n,), generator=g))  # noqa: E731
    msgs = []
    for t in range(turns):
        msgs += [("user", words(3 + t)), ("assistant", words(5 + 2 * t))]
    if style == "role":
        return [{"role": r, "content": c} for r, c in msgs]
    return [{"from": {"user": "human", "assistant": "gpt"}[r], "value": c} for r, c in msgs]


def expected_think_last(messages, last_only=False):
    """Ids and loss mask of THINK_LAST's rendering, built token by token (one word, one token)."""
    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    ids, mask = [], []
    n_assist = sum(m["role"] == "assistant" for m in messages)
    k = 0
    for i, m in enumerate(messages):
        ids += [vocab["<im_start>"], vocab[m["role"]]]
        mask += [0, 0]
        body = m["content"].split() + ["<im_end>"]
        if m["role"] == "assistant" and i == len(messages) - 1:
            body = ["<think>", "</think>"] + body
        k += m["role"] == "assistant"
        on = m["role"] == "assistant" and (not last_only or k == n_assist)
        ids += [vocab[w] for w in body]
        mask += [int(on)] * len(body)
    return ids, mask


# ------------------------------------------------------------------------------------ defaults for a target
def test_defaults_fit_the_target():
    # Qwen3-8B: SpecForge's settings
    assert default_num_draft_layers(36) == 5 and fit_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    s = fresh_settings(4096, 151936, {})
    assert (s.transfer_rank, s.message_size) == (1024, 512)
    # the built-in 4-layer target: what the default pair was trained with
    assert default_num_draft_layers(4) == 2 and fit_target_layer_ids(4, 2) == [1, 2]
    s = fresh_settings(256, 4096, {})
    assert (s.transfer_rank, s.message_size) == (64, 32)
    assert fresh_settings(256, 4096, {"transfer_rank": 40}).message_size == 20
    # DFlash's rule gives repeated ids on shallow targets: distinct ones instead, as many as fit
    for n in range(1, 40):
        for k in range(1, 7):
            ids = fit_target_layer_ids(n, k)
            assert ids == sorted(set(ids)) and all(0 <= i < n for i in ids) and len(ids) <= k, (n, k, ids)
    assert fit_target_layer_ids(6, 5) == [1, 2, 3, 4]


def test_mask_token_from_the_tokenizer():
    with_mask = word_tokenizer(extra=["<|MASK|>"], mask_token="<|MASK|>")
    assert default_mask_token(with_mask, 100)[0] == len(SPECIALS) + len(WORDS)
    in_vocab = word_tokenizer(extra=["<|MASK|>", "w55"])  # <|MASK|> present but not declared the mask token
    assert default_mask_token(in_vocab, 100)[0] == len(SPECIALS) + len(WORDS)
    # Qwen3's case: no mask token; adding <|MASK|> would give the next id (151669 there)
    plain = word_tokenizer()
    assert default_mask_token(plain, 64) == (63, default_mask_token(plain, 64)[1])
    assert len(plain) == 63
    with pytest.raises(DrafterConfigError, match="--mask-token-id"):
        default_mask_token(plain, 63)  # the tokenizer fills the embedding: nothing free to use


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny target folder (4 layers, vocab 64) with THINK_LAST, and token data the target answered."""
    d = tmp_path_factory.mktemp("inputs")
    t = make_target(seed=0)
    t.save_pretrained(d / "target")
    word_tokenizer(path=d / "target")
    g = torch.Generator().manual_seed(4)
    with open(d / "tokens.jsonl", "w") as f:
        for n in (14, 9, 12, 10):
            p = torch.randint(8, 62, (5,), generator=g).tolist()
            out = t.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                             attention_mask=torch.ones(1, 5, dtype=torch.long))[0, 5:].tolist()
            f.write(json.dumps({"input_ids": p + out, "loss_mask": [0] * 5 + [1] * len(out)}) + "\n")
    with open(d / "chats.jsonl", "w") as f:
        for i in range(6):
            f.write(json.dumps({"id": f"c{i}", "conversations": chat(i, turns=1 + i % 2, style="from" if i % 2 else "role")})
                    + "\n")
    return d


SMALL = ["--block-size", "4", "--num-anchors", "8", "--batch-size", "2", "--max-steps", "2", "--log-every", "1",
         "--no-progress", "--top-k", "4"]


def run_cli(args, capsys):
    rc = cli_main(args)
    return rc, capsys.readouterr().err


def test_flag_named_errors(tiny_dir, tmp_path, capsys):
    base = ["train", "--target", str(tiny_dir / "target"), "--data", str(tiny_dir / "tokens.jsonl"),
            "--output-dir", str(tmp_path / "run")] + SMALL
    rc, err = run_cli(base + ["--transfer-rank", "1024"], capsys)
    assert rc == 2 and "--transfer-rank 1024: expected at most 63 for this target" in err and "config.json" not in err
    rc, err = run_cli(base + ["--target-layer-ids", "1,7"], capsys)
    assert rc == 2 and "--target-layer-ids 1,7: expected ids in [0, 4)" in err
    rc, err = run_cli(base + ["--mask-token-id", "64"], capsys)
    assert rc == 2 and "--mask-token-id 64: expected in [0, 64)" in err
    rc, err = run_cli(base + ["--top-k", "65"], capsys)
    assert rc == 2 and "--top-k 65: expected at most 64" in err
    rc, err = run_cli(base + ["--ce-weight", "2"], capsys)
    assert rc == 2 and "--ce-weight 2.0: expected in [0, 1]" in err
    rc, err = run_cli(base + ["--num-draft-layers", "0"], capsys)
    assert rc == 2 and "--num-draft-layers 0: expected >= 1" in err
    assert not os.path.exists(tmp_path / "run" / "final")


def test_train_defaults_on_a_small_target(tiny_dir, tmp_path, capsys):
    """No drafter flags at all on a 4-layer, 64-token target: the choices fit it and are reported."""
    out = tmp_path / "run"
    rc, err = run_cli(["train", "--target", str(tiny_dir / "target"), "--data", str(tiny_dir / "tokens.jsonl"),
                       "--output-dir", str(out), "--block-size", "4", "--num-anchors", "8", "--max-steps", "1",
                       "--no-progress", "--no-tensorboard", "--top-k", "4"], capsys)
    assert rc == 0, err
    used = json.load(open(out / "train_config.json"))["drafter"]
    assert used["num_draft_layers"] == 2 and used["target_layer_ids"] == [1, 2]
    assert used["mask_token_id"] == 63 and "<|MASK|>" in used["mask_token_source"]  # len(tokenizer) = 63
    assert used["dspine"]["transfer_rank"] == 16 and used["dspine"]["message_size"] == 8
    assert "2 layers, target layers [1, 2], mask token 63" in err


# ------------------------------------------------------------------------------------------- conversations
@pytest.mark.parametrize("last_only", [False, True])
def test_conversation_tokens_and_loss_mask(last_only):
    tok = word_tokenizer()
    fmt = ChatFormat(resolve_template(tok, None), last_turn_only=last_only)
    for seed in range(4):
        msgs = chat(seed, turns=1 + seed % 3)
        ids, mask = tokenize_conversation(msgs, tok, fmt)
        assert (ids, mask) == expected_think_last(msgs, last_only), seed


def test_conversation_on_the_builtin_target_tokenizer():
    """The built-in target's BPE tokenizer and ChatML template: the loss covers each answer and its <|im_end|>."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DEFAULT_TARGET)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": "2 + 3 = 5."}, {"role": "user", "content": "And 4 * 6?"},
            {"role": "assistant", "content": "It is 24.\nDone."}]
    for last_only in (False, True):
        ids, mask = tokenize_conversation(msgs, tok, ChatFormat(resolve_template(tok, None), last_turn_only=last_only))
        text = tok.apply_chat_template(msgs, tokenize=False)
        assert ids == tok(text, add_special_tokens=False)["input_ids"]
        on = tok.decode([i for i, m in zip(ids, mask) if m])
        answers = [m["content"] for m in msgs if m["role"] == "assistant"][-1 if last_only else 0:]
        assert on == "".join(a + "<|im_end|>" for a in answers)
        # every loss run is one answer: the tokens between runs are the template's and the user's
        runs = sum(1 for i in range(len(mask)) if mask[i] and (i == 0 or not mask[i - 1]))
        assert runs == len(answers)


def test_chat_template_choice_and_missing_template(tiny_dir, tmp_path):
    bare = word_tokenizer(template=None)
    msgs = chat(0)
    with pytest.raises(DataError, match="no chat template; give --chat-template"):
        resolve_template(bare, None)
    with pytest.raises(DataError, match="--chat-template nope: not a file"):
        resolve_template(bare, "nope")
    # a template file; the built-in chatml by name
    path = tmp_path / "t.jinja"
    path.write_text(THINK_LAST)
    assert tokenize_conversation(msgs, bare, ChatFormat(resolve_template(bare, str(path)))) == expected_think_last(msgs)
    assert "<|im_start|>" in resolve_template(bare, "chatml")
    # `plain` renders prompts for a base model, but cannot mark assistant turns: refused for training
    ids = prompt_ids({"prompt": "w1 w2"}, bare, chat_template="plain")
    assert ids == bare("w1 w2")["input_ids"]
    with pytest.raises(DataError, match="no chat template"):
        prompt_ids({"prompt": "w1 w2"}, bare)  # never a silent plain-text rendering
    with pytest.raises(DataError, match="cannot be told"):
        tokenize_conversation(msgs, bare, ChatFormat(resolve_template(bare, "plain")))
    # in the training data reader: the error names the file, line and flag
    with pytest.raises(DataError, match=r"chats.jsonl:1: the tokenizer has no chat template; give --chat-template"):
        list(iter_token_data(str(tiny_dir / "chats.jsonl"), bare))
    with pytest.raises(DataError, match="needs the target's tokenizer"):
        list(iter_token_data(str(tiny_dir / "chats.jsonl"), None))


def test_train_on_specforge_conversations(tiny_dir, tmp_path, capsys):
    """A SpecForge conversation file trains as it is; `data --no-regenerate` writes the same tokens once."""
    tok = word_tokenizer()
    recs = list(iter_token_data(str(tiny_dir / "chats.jsonl"), tok))
    raw = read_jsonl(str(tiny_dir / "chats.jsonl"))
    for rec, src in zip(recs, raw):
        from sglang_dspine.training.chat import normalise_messages

        assert (rec["input_ids"], rec["loss_mask"]) == expected_think_last(normalise_messages(src["conversations"], "t"))
    out = tmp_path / "tok.jsonl"
    rc, err = run_cli(["data", "--target", str(tiny_dir / "target"), "--prompts", str(tiny_dir / "chats.jsonl"),
                       "--output", str(out), "--no-regenerate", "--no-progress"], capsys)
    assert rc == 0, err
    written = read_jsonl(str(out))
    assert [(r["input_ids"], r["loss_mask"]) for r in written] == [(r["input_ids"], r["loss_mask"]) for r in recs]
    assert all(r["loss_mask"][r["prompt_len"]] == 1 and 1 not in r["loss_mask"][: r["prompt_len"]] for r in written)
    # train on the conversation file itself, and on the last turns only
    for extra in ([], ["--last-turn-only"]):
        run = tmp_path / f"run{len(extra)}"
        rc, err = run_cli(["train", "--target", str(tiny_dir / "target"), "--data", str(tiny_dir / "chats.jsonl"),
                           "--output-dir", str(run), "--no-tensorboard"] + SMALL + extra, capsys)
        assert rc == 0, err
        assert [m["step"] for m in read_jsonl(str(run / "metrics.jsonl"))] == [1, 2]
        assert "6 sequences" in err


# ----------------------------------------------------------------------------------------- logs and resume
def test_tensorboard_beside_metrics_jsonl(tiny_dir, tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    rc, err = run_cli(["train", "--target", str(tiny_dir / "target"), "--data", str(tiny_dir / "tokens.jsonl"),
                       "--output-dir", str(run)] + SMALL, capsys)
    assert rc == 0, err
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    recs = read_jsonl(str(run / "metrics.jsonl"))
    for key in ("loss", "accuracy", "tokens_per_s", "lr", "refinement"):
        events = acc.Scalars(f"train/{key}")
        assert [e.step for e in events] == [1, 2]
        assert [e.value for e in events] == pytest.approx([r[key] for r in recs], rel=1e-6)
    assert len(acc.Scalars("train/accuracy_pos/3")) == 2
    import importlib.util

    if importlib.util.find_spec("wandb") is None:
        rc, err = run_cli(["train", "--target", str(tiny_dir / "target"), "--data", str(tiny_dir / "tokens.jsonl"),
                           "--output-dir", str(tmp_path / "w"), "--wandb-project", "p"] + SMALL, capsys)
        assert rc == 2 and "--wandb-project: the `wandb` package is not installed" in err


class _RunsCode:
    """Unpickling this calls os.mkdir(path): what a hostile trainer_state.pt could do."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


def test_resume_state_cannot_run_code(tiny_dir, tmp_path, capsys):
    run = tmp_path / "run"
    args = ["train", "--target", str(tiny_dir / "target"), "--data", str(tiny_dir / "tokens.jsonl"),
            "--output-dir", str(run), "--no-tensorboard"] + SMALL
    assert run_cli(args, capsys)[0] == 0
    state = load_trainer_state(str(run / "checkpoint-2"))
    assert state["step"] == 2 and isinstance(state["rng"]["torch"], torch.Tensor)
    # the same file with a code-running object inside: refused, and the code never runs
    marker = tmp_path / "pwned"
    state["optimizer"]["evil"] = _RunsCode(str(marker))
    torch.save(state, run / "checkpoint-2" / "trainer_state.pt")  # pickles the object; nothing runs yet
    shutil.rmtree(run / "final")  # an unfinished run: the same command resumes it from checkpoint-2
    rc, err = run_cli(args, capsys)
    assert rc == 2 and "refused: not a plain trainer state" in err and "trainer_state.pt" in err
    assert not marker.exists()
    with pytest.raises(DrafterConfigError, match="refused"):
        load_trainer_state(str(run / "checkpoint-2"))
    assert not marker.exists()


def test_single_process_inside_a_larger_world(tiny_dir, tmp_path, monkeypatch):
    """train(single_process=True) ignores torchrun's WORLD_SIZE (train_scale's one-GPU run)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    s = train(TrainConfig(data=str(tiny_dir / "tokens.jsonl"), output_dir=str(tmp_path / "r"), block_size=4,
                          num_anchors=8, max_steps=1, progress=False, save=False, tensorboard=False,
                          dspine=dict(top_k=4), device="cpu"), target=make_target(seed=0), single_process=True)
    assert s["steps"] == 1 and s["final"] is None and not os.path.exists(tmp_path / "r" / "final")
