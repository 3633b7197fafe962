"""fastai's applications as their docs and the book build them, as training scripts the tests run in new
processes, from the folder they are started in, with fastai's default relative paths:

    python tests/apps.py APP --out OUT [--die S,E,K] [--resume manual|auto] [--every N] [--break-rng]

APP:
- `text`: the ULMFiT recipe of fastai's text tutorial and the book's chapter 10 on generated English text
  with fastai's own (spaCy) tokenizer: `TextDataLoaders.from_df(is_lm=True)`, `language_model_learner`
  (frozen as a pretrained one is): fit_one_cycle, save('1epoch'), load('1epoch'), unfreeze,
  fit_one_cycle, save_encoder; then `TextDataLoaders.from_df` with the LM's vocab,
  `text_classifier_learner`, load_encoder, fit_one_cycle, freeze_to(-2), fit_one_cycle, unfreeze,
  fit_one_cycle. Stages are counted over the script: 0-1 the language model, 2-4 the classifier.
- `vision`: `ImageDataLoaders.from_name_func` over PNG files, `vision_learner(resnet18)`, `fine_tune(2)`.
- `unet`: `SegmentationDataLoaders.from_label_func`, `unet_learner(resnet18)`, `fine_tune(1)`.
- `tabular`: `TabularDataLoaders.from_df` (Categorify, FillMissing, Normalize), `tabular_learner`,
  `fit_one_cycle(3)`.
- `collab`: `CollabDataLoaders.from_df`, `collab_learner(n_factors=8, y_range=(0, 5.5))`,
  `fit_one_cycle(4, 5e-3, wd=0.1)`.

Between stages the script prints what users print (the Recorder's last row, `validate()`), as the
lines `VALUES ...`. `--resume manual`: a callback of the user's saves `crash` every N batches
(`learn.save('crash', with_iter=True)`), and the script loads it at the top when it exists; `--resume
auto`: `AutoCheckpoint(every_iters=N)` in each learner. `--die S,E,K`: in stage S, after K training
batches of epoch E, once the checkpoint is saved, SIGKILL. OUT gets every learner's final model,
optimizer and Recorder, the files the script wrote (by CRC32C) and its printed values.
"""

import argparse
import os
import random
import re
import signal
import sys

import numpy as np
import pandas as pd

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from results import learner_result  # noqa: E402

import fastai_resume  # noqa: E402
import fastai_resume.script  # noqa: E402
from fastai_resume.between import file_crc  # noqa: E402

STAGE = [0]  # the script's stage counter (over both learners of `text`)


def corpus(n=240, seed=0):
    "Short reviews made of a small English vocabulary, labelled by the words they use."
    r = random.Random(seed)
    pos = "good great fine lovely superb nice wonderful happy".split()
    neg = "bad awful poor terrible sad boring ugly dull".split()
    nouns = "movie film plot actor story scene music ending cast script".split()
    verbs = "was seemed felt looked became remained".split()
    fill = "the a this that really quite very so and but it i".split()
    rows = []
    for _ in range(n):
        lab = r.random() < 0.5
        words = []
        for _ in range(r.randint(2, 5)):
            words += [r.choice(fill).capitalize(), r.choice(nouns), r.choice(verbs), r.choice(fill)]
            words += [r.choice(pos if lab else neg), "."]
        rows.append((" ".join(words), "pos" if lab else "neg"))
    return pd.DataFrame(rows, columns=["text", "label"])


def digit_images(folder, n=240, seg=False):
    "scikit-learn's digits as 24x24 PNG files (`3_017.png`), and for segmentation their ink masks."
    from PIL import Image
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    os.makedirs(os.path.join(folder, "images"), exist_ok=True)
    if seg:
        os.makedirs(os.path.join(folder, "masks"), exist_ok=True)
    for i in range(n):
        img = (X[i].reshape(8, 8) * 16).clip(0, 255).astype(np.uint8)
        big = np.kron(img, np.ones((3, 3), dtype=np.uint8))
        Image.fromarray(np.stack([big] * 3, -1)).save(os.path.join(folder, "images", f"{y[i]}_{i:03d}.png"))
        if seg:
            Image.fromarray((big > 64).astype(np.uint8)).save(os.path.join(folder, "masks", f"{y[i]}_{i:03d}.png"))


class Stages:
    "Counts the script's stages (both learners of `text`) and dies where told."

    def __init__(self, a):
        self.a = a
        self.die = tuple(map(int, a.die.split(","))) if a.die else None
        self.die_mid = tuple(map(int, a.die_mid.split(","))) if a.die_mid else None

    def cbs(self, learn, name="crash"):
        "The user's checkpoint callbacks of a learner whose resumable checkpoints are named `name`."
        from fastai.callback.core import Callback

        a, die, die_mid = self.a, self.die, self.die_mid

        class UserSaver(Callback):
            "What a user writes to save a resumable checkpoint every N batches."

            order = 90

            def after_batch(self):
                if self.training and a.resume == "manual" and self.learn.train_iter % a.every == 0:
                    self.learn.save(name, with_iter=True)

        class Die(Callback):
            order = 120

            def after_pred(self):  # `--die-mid`: in the middle of the next batch's step, no save of its own
                sc = fastai_resume.script.script(self.learn)
                if die_mid is None or not self.training or sc.stage is None:
                    return
                if (STAGE[0] + sc.stage.index, self.epoch, self.iter) == die_mid:
                    sys.stdout.flush()
                    os.kill(os.getpid(), signal.SIGKILL)

            def after_batch(self):
                sc = fastai_resume.script.script(self.learn)
                if die is None or not self.training or sc.stage is None:
                    return
                if (STAGE[0] + sc.stage.index, self.epoch, self.iter + 1) != die:
                    return
                if a.resume == "manual":
                    self.learn.save(name, with_iter=True)
                else:
                    auto = next(c for c in self.learn.cbs if isinstance(c, fastai_resume.AutoCheckpoint))
                    auto._save(background=False)
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)

        out = [] if a.resume == "none" else [UserSaver(), Die()]
        if a.resume == "auto":
            out.append(fastai_resume.AutoCheckpoint(every_iters=a.every, keep=2))
        return out

    def start(self, learn, name):
        "The top of a learner's part of the script: `learn.load(name)` when resuming by hand."
        if self.a.resume == "manual" and os.path.exists(os.path.join("models", name + ".frk")):
            learn.load(name)
            if self.a.break_rng:  # negative control: resume without the saved RNG state
                tr = fastai_resume.script.script(learn).armed.train
                tr["rng"] = tr["rng_epoch"] = fastai_resume.state.rng_state()
        return learn

    def done(self, learn):
        STAGE[0] += len(fastai_resume.script.script(learn).signatures)


def values(tag, v):
    print(f"\nVALUES {tag} {[round(float(x), 6) for x in v]}", flush=True)


def text(a, st, out):
    from fastai.text.all import (
        AWD_LSTM,
        Perplexity,
        TextDataLoaders,
        accuracy,
        awd_lstm_clas_config,
        awd_lstm_lm_config,
        language_model_learner,
        text_classifier_learner,
    )

    df = corpus()
    dls_lm = TextDataLoaders.from_df(df, text_col="text", is_lm=True, valid_pct=0.1, seq_len=16, bs=16, seed=0)
    cfg = dict(awd_lstm_lm_config, emb_sz=32, n_hid=64, n_layers=2)
    learn = language_model_learner(
        dls_lm, AWD_LSTM, config=cfg, pretrained=False, drop_mult=0.3, metrics=[accuracy, Perplexity()]
    )
    learn.add_cbs(st.cbs(learn, "lm-crash"))
    learn = st.start(learn, "lm-crash")
    learn.freeze()  # as language_model_learner leaves a pretrained model
    learn.fit_one_cycle(1, 2e-2)
    values("lm-0", learn.recorder.values[-1])
    learn.save("1epoch")
    learn = learn.load("1epoch")
    learn.unfreeze()
    learn.fit_one_cycle(2, 2e-3)
    values("lm-1", learn.recorder.values[-1])
    values("lm-valid", learn.validate())
    learn.save_encoder("finetuned")
    out["lm"] = learner_result(learn)
    st.done(learn)

    dls = TextDataLoaders.from_df(
        df, text_col="text", label_col="label", valid_pct=0.1, text_vocab=dls_lm.vocab, bs=16, seed=0
    )
    ccfg = dict(awd_lstm_clas_config, emb_sz=32, n_hid=64, n_layers=2)
    learn = text_classifier_learner(dls, AWD_LSTM, config=ccfg, pretrained=False, drop_mult=0.5, metrics=accuracy)
    learn.add_cbs(st.cbs(learn, "clas-crash"))
    learn = st.start(learn, "clas-crash")
    learn = learn.load_encoder("finetuned")
    learn.fit_one_cycle(1, 2e-2)
    values("clas-0", learn.recorder.values[-1])
    learn.freeze_to(-2)
    learn.fit_one_cycle(1, slice(1e-2 / (2.6**4), 1e-2))
    values("clas-1", learn.recorder.values[-1])
    learn.unfreeze()
    learn.fit_one_cycle(2, slice(1e-3 / (2.6**4), 1e-3))
    values("clas-2", learn.recorder.values[-1])
    out["clas"] = learner_result(learn)
    st.done(learn)


def vision(a, st, out, seg=False):
    from fastai.vision.all import (
        ImageDataLoaders,
        Resize,
        SegmentationDataLoaders,
        error_rate,
        get_image_files,
        resnet18,
        unet_learner,
        vision_learner,
    )

    if not os.path.isdir("images"):
        digit_images(".", seg=seg)
    files = get_image_files("images")
    if seg:
        dls = SegmentationDataLoaders.from_label_func(
            ".", files, lambda f: os.path.join("masks", f.name), codes=["ink", "paper"], bs=16, seed=0, num_workers=0
        )
        learn = unet_learner(dls, resnet18, pretrained=False)
    else:
        dls = ImageDataLoaders.from_name_func(
            ".", files, lambda name: name[0], item_tfms=Resize(24), bs=16, seed=0, num_workers=2
        )
        learn = vision_learner(dls, resnet18, pretrained=False, metrics=error_rate)
    learn.add_cbs(st.cbs(learn))
    learn = st.start(learn, "crash")
    learn.fine_tune(1 if seg else 2)
    values("valid", learn.validate())
    out["model"] = learner_result(learn)


def tabular(a, st, out):
    from fastai.tabular.all import Categorify, FillMissing, Normalize, TabularDataLoaders, accuracy, tabular_learner
    from sklearn.datasets import load_breast_cancer

    data = load_breast_cancer(as_frame=True)
    df = data.frame.copy()
    df["size"] = pd.cut(df["mean radius"], 4, labels=["s", "m", "l", "xl"]).astype(str)
    df.loc[::17, "mean texture"] = np.nan  # FillMissing has work to do
    df["target"] = df["target"].map({0: "malignant", 1: "benign"})
    cont = [c for c in data.feature_names[:12]]
    dls = TabularDataLoaders.from_df(
        df,
        procs=[Categorify, FillMissing, Normalize],
        cat_names=["size"],
        cont_names=cont,
        y_names="target",
        valid_idx=list(range(0, len(df), 5)),
        bs=32,
    )
    learn = tabular_learner(dls, layers=[32, 16], metrics=accuracy)
    learn.add_cbs(st.cbs(learn))
    learn = st.start(learn, "crash")
    learn.fit_one_cycle(3)
    values("valid", learn.validate())
    out["model"] = learner_result(learn)


def collab(a, st, out):
    from fastai.collab import CollabDataLoaders, collab_learner

    g = np.random.default_rng(0)
    users, items = g.normal(size=(60, 3)), g.normal(size=(40, 3))
    u, i = g.integers(0, 60, 1500), g.integers(0, 40, 1500)
    r = np.clip(2.75 + (users[u] * items[i]).sum(1) + 0.3 * g.normal(size=1500), 0.5, 5)
    df = pd.DataFrame({"user": u, "item": i, "rating": r.round(1)}).drop_duplicates(["user", "item"])
    dls = CollabDataLoaders.from_df(df, bs=64, seed=0)
    learn = collab_learner(dls, n_factors=8, y_range=(0, 5.5))
    learn.add_cbs(st.cbs(learn))
    learn = st.start(learn, "crash")
    learn.fit_one_cycle(4, 5e-3, wd=0.1)
    values("valid", learn.validate())
    out["model"] = learner_result(learn)


def pretrained(folder, seed):
    """A small causal LM and its tokenizer written as a hub download leaves them (`save_pretrained`), once
    per folder and seed: the script loads them with `from_pretrained`, as a user's script does."""
    import json

    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    mark = os.path.join(folder, "seed.json")
    if os.path.exists(mark) and json.load(open(mark)) == seed:
        return
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(corpus()["text"], trainers.WordLevelTrainer(special_tokens=["[UNK]", "[EOS]"]))
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[EOS]")
    hf_tok.save_pretrained(folder)
    torch.manual_seed(seed)
    n = tok.get_vocab_size()
    cfg = GPT2Config(vocab_size=n, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=1, eos_token_id=1)
    GPT2LMHeadModel(cfg).save_pretrained(folder)
    with open(mark, "w") as f:
        json.dump(seed, f)


def llm(a, st, out):
    """fastai's Hugging Face tutorial (a `transformers` causal LM in a `Learner`, `TfmdLists` with
    `dl_type=LMDataLoader`, `DropOutput`, `lr_find`, `fit_one_cycle`) with what LLM users add: LoRA adapters
    from `peft` on the attention, gradient accumulation, and the adapter saved with `save_pretrained`."""
    from fastai.text.all import (
        Callback,
        CrossEntropyLossFlat,
        GradientAccumulation,
        Learner,
        LMDataLoader,
        Perplexity,
        TfmdLists,
        Transform,
        tensor,
    )
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pretrained("pretrained", a.base_seed)
    tokenizer = AutoTokenizer.from_pretrained("pretrained")
    model = AutoModelForCausalLM.from_pretrained("pretrained")
    if a.copy_base:  # the base a copy in this process's memory (as a torch.load or another dtype makes), not the file's
        for p in model.parameters():
            p.data = p.data.clone()
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.1))

    class TransformersTokenizer(Transform):
        def __init__(self, tokenizer):
            self.tokenizer = tokenizer

        def encodes(self, x):
            return tensor(self.tokenizer.convert_tokens_to_ids(self.tokenizer.tokenize(x)))

    class DropOutput(Callback):
        def after_pred(self):
            self.learn.pred = self.pred[0]

    texts = list(corpus()["text"])
    splits = [list(range(200)), list(range(200, len(texts)))]
    tls = TfmdLists(texts, TransformersTokenizer(tokenizer), splits=splits, dl_type=LMDataLoader)
    dls = tls.dataloaders(bs=8, seq_len=16)
    learn = Learner(
        dls,
        model,
        loss_func=CrossEntropyLossFlat(),
        cbs=[DropOutput, GradientAccumulation(n_acc=24)],
        metrics=Perplexity(),
    )
    learn.add_cbs(st.cbs(learn))
    learn = st.start(learn, "crash")
    learn.lr_find(num_it=10, show_plot=False)
    if a.touch_frozen:  # a callback that writes into the frozen base mid-fit (merge code, an EMA into the base)
        learn.add_cb(TouchFrozen())
    learn.fit_one_cycle(2, 3e-3)
    values("valid", learn.validate())
    learn.model.save_pretrained("adapter")
    out["model"] = learner_result(learn)
    if a.copy_base:
        from fastai_resume import unwritten

        print(f"TRACKED {unwritten.stats()}")


class TouchFrozen:
    "Adds 1 to the first row of the (frozen) token embedding after the 5th batch of the first epoch."

    def __new__(cls):
        from fastai.callback.core import Callback

        class _Touch(Callback):
            def after_batch(self):
                if self.training and self.epoch == 0 and self.iter == 4:
                    emb = self.learn.model.get_input_embeddings().weight
                    assert not emb.requires_grad
                    emb.data[0] += 1

        return _Touch()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("app", choices=["text", "vision", "unet", "tabular", "collab", "llm"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--die", default=None)
    ap.add_argument("--die-mid", default=None)  # S,E,K: SIGKILL in the step of batch K+1 (its forward done), unsaved
    ap.add_argument("--die-publishing", type=int, default=None)  # K: SIGKILL as the save of iteration K is published
    ap.add_argument("--resume", default="manual", choices=["none", "manual", "auto"])
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--break-rng", action="store_true")
    ap.add_argument("--base-seed", type=int, default=0)  # llm: the "pretrained" base model's weights
    ap.add_argument("--touch-frozen", action="store_true")  # llm: a callback writes into the frozen base
    ap.add_argument("--copy-base", action="store_true")  # llm: the base's weights copied (not the file's pages)
    ap.add_argument("--no-base-check", action="store_true")  # negative control: the fingerprint check removed
    a = ap.parse_args(argv)
    from fastai.torch_core import set_seed

    set_seed(42)
    if a.no_base_check:
        fastai_resume.frozen.check = lambda model, tree, path, **kw: None
        fastai_resume.frozen.not_yet = lambda model, tree, **kw: []
        fastai_resume.frozen.recheck = lambda model, checked, source: None
    if a.die_publishing is not None:  # killed by its thread once the checkpoint is written whole, before it is in place
        commit = fastai_resume.snapshot.BackgroundCommit
        publish = commit._run

        def _run(self, path, fsync):
            if self.written_now and int(re.search(r"-i(\d+)\.frk$", path)[1]) == a.die_publishing:
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            return publish(self, path, fsync)

        commit._run = _run
    st, out = Stages(a), {}
    if a.app == "unet":
        vision(a, st, out, seg=True)
    else:
        {"text": text, "vision": vision, "tabular": tabular, "collab": collab, "llm": llm}[a.app](a, st, out)
    files = {}
    for d in ("models", ".", "adapter"):
        for f in sorted(os.listdir(d)) if os.path.isdir(d) else []:
            p = os.path.join(d, f)
            if os.path.isfile(p) and f.endswith((".pth", ".pkl", ".safetensors", "config.json")):
                files[p] = file_crc(p)
    out["files"] = files
    fastai_resume.save(out, a.out)


if __name__ == "__main__":
    main()
