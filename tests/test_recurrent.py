"""Recurrent layers (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``) traced unrolled over time: they plan with
the batch split, train on 4 simulated ranks as on one device, and packing a sequence stops
tracing with an error naming it. (On real gloo processes: ``test_gloo_models``.)"""

import pytest
import torch
from conftest import fake_mesh
from parallel_run import close, one_value
from torch import nn
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from autoplan import AutoParallel, TracingError

IO = (Shard(0), Replicate())
VOCAB, BATCH, SEQ = 50, 8, 6


class Recurrent(nn.Module):
    def __init__(self, rnn: nn.Module, out_features: int):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.rnn = rnn
        self.head = nn.Linear(out_features, VOCAB)

    def forward(self, ids):
        out, _ = self.rnn(self.embed(ids))
        return self.head(out)


LAYERS = {
    "lstm": lambda: Recurrent(nn.LSTM(16, 16, num_layers=2, batch_first=True), 16),
    "lstm_proj": lambda: Recurrent(nn.LSTM(16, 16, batch_first=True, proj_size=8), 8),
    "gru_bidirectional": lambda: Recurrent(nn.GRU(16, 16, batch_first=True, bidirectional=True), 32),
    "rnn_relu_time_major": lambda: Recurrent(nn.RNN(16, 16, nonlinearity="relu", num_layers=2), 16),
}


@pytest.mark.parametrize("name", list(LAYERS))
def test_recurrent_layers_match_one_device(name):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    target = torch.randn(BATCH, SEQ, VOCAB, generator=g)
    torch.manual_seed(0)
    ref = LAYERS[name]()
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    loss = (ref(ids) - target).square().mean()
    loss.backward()

    mesh = fake_mesh((2, 2))
    with torch.device("meta"):
        model = LAYERS[name]()
    with AutoParallel(model, mesh, lambda: torch.zeros(BATCH, SEQ, dtype=torch.long)) as ap:
        ap.add_input_constraints([IO])
        ap.add_output_constraints([IO])
        plan = ap.optimize_placement()
        pmod = ap.apply_placement(plan)
    targets = {str(n.target) for n in ap.traced.gm.graph.nodes}
    assert not any("rnn" in t for t in targets), targets  # unrolled: matmuls and gates only
    with LocalTensorMode(4):
        pmod.to_empty(device="cpu")
        pmod.load_state_dict(state)
        out = DTensor.from_local(pmod(distribute_tensor(ids, mesh, IO).to_local()), mesh, IO, run_check=False)
        mine = (out - distribute_tensor(target, mesh, IO)).square().mean()
        mine.backward()
        assert close(one_value(mine, 4), loss.detach())
        bad = [n for n, p in pmod.named_parameters() if not close(one_value(p.grad, 4), ref.get_parameter(n).grad)]
    assert not bad, bad


def test_packed_sequence_is_refused_by_name():
    """Packing reads the lengths' values to shape the batch of each step: tracing stops there, naming it."""

    class Packed(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(4, 4, batch_first=True)

        def forward(self, x):
            packed = nn.utils.rnn.pack_padded_sequence(x, torch.tensor([3, 2]), batch_first=True)
            return self.lstm(packed)[0].data

    with torch.device("meta"):
        model = Packed()
    with pytest.raises(TracingError, match="_pack_padded_sequence.*depends on tensor data"):
        with AutoParallel(model, fake_mesh((2, 2)), lambda: torch.randn(2, 3, 4)):
            pass
