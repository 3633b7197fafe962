"""What a training script's run leaves in its learner, as a tree to compare bitwise with another run's
(the scripts the tests run write it to their --out file)."""

import fastai_resume


def learner_result(learn) -> dict:
    "The model, the optimizer and the Recorder's history."
    rec = learn.recorder
    return {
        "model": {k: v.clone() for k, v in learn.model.state_dict().items()},
        "opt": fastai_resume.state.plain(learn.opt.state_dict()),
        "losses": [float(x) for x in rec.losses],
        "lrs": [float(x) for x in rec.lrs],
        "values": [[float(v) for v in row] for row in rec.values],
    }
