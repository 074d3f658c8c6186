"""The synthetic PPO data and policy of ``ppo_grad_accum.py``: one mini-batch per optimizer update.

Every optimizer update's mini-batch is drawn from (seed, update index) alone, so a layout (ranks x micro-batches x
updates per step) only decides who computes which sequences and when a step ends, never what the sequences are.
A sequence is a prompt token followed by a response of random length; "good" responses mostly follow the pattern
``next = (prev + 1) % vocab``, and the reward is the fraction of pattern-following transitions, so the policy has
something real to learn.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPE = torch.float64  # float64 everywhere: layouts differ only in summation order, ~1e-15 per update


@dataclass(frozen=True)
class Shape:
    """The size of the problem."""

    vocab: int = 32
    hidden: int = 64
    batch: int = 16  # sequences per mini-batch (verl's ppo_mini_batch_size); must divide by ranks * micro-batches
    min_len: int = 4
    max_len: int = 48


@dataclass
class Batch:
    """A set of sequences flattened into (context token -> next token) pairs, one per response token."""

    context: torch.Tensor  # (tokens,) long
    target: torch.Tensor  # (tokens,) long
    advantage: torch.Tensor  # (tokens,) float64: the sequence's advantage on each of its tokens
    old_logp_noise: torch.Tensor  # (tokens,) float64: how far the behaviour policy was from the current one
    lengths: torch.Tensor  # (sequences,) long: response lengths

    @property
    def n_tokens(self) -> int:
        """Response tokens in the batch."""
        return int(self.target.numel())


@dataclass
class MiniBatch:
    """One optimizer update's sequences (all ranks together), as lists so a layout can shard them."""

    sequences: list[torch.Tensor]  # each (length + 1,) long: prompt token, then the response
    advantages: torch.Tensor  # (sequences,)
    noise: list[torch.Tensor]  # each (length,)

    @property
    def n_tokens(self) -> int:
        """Response tokens in the whole mini-batch: the normalizer of verl's token-mean loss (batch_num_tokens)."""
        return sum(len(s) - 1 for s in self.sequences)

    def shard(self, *, rank: int, ranks: int, micro: int, micros: int) -> Batch:
        """Micro-batch ``micro`` of rank ``rank``: contiguous equal slices of sequences."""
        n = len(self.sequences)
        if n % (ranks * micros):
            raise ValueError(f"a mini-batch of {n} sequences does not split into {ranks} ranks x {micros} micros")
        per = n // (ranks * micros)
        lo = (rank * micros + micro) * per
        idx = range(lo, lo + per)
        seqs = [self.sequences[i] for i in idx]
        return Batch(
            context=torch.cat([s[:-1] for s in seqs]),
            target=torch.cat([s[1:] for s in seqs]),
            advantage=torch.cat([self.advantages[i].expand(len(self.sequences[i]) - 1) for i in idx]),
            old_logp_noise=torch.cat([self.noise[i] for i in idx]),
            lengths=torch.tensor([len(s) - 1 for s in seqs]),
        )


def mini_batch(*, update: int, seed: int, shape: Shape) -> MiniBatch:
    """The mini-batch of optimizer update number ``update`` (counted over the whole run): a function of
    (seed, update, shape) only."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + update)
    n, longest = shape.batch, shape.max_len
    lengths = torch.randint(shape.min_len, longest + 1, (n,), generator=gen).tolist()
    follow = torch.where(torch.rand(n, generator=gen) < 0.5, 0.9, 0.1)  # a good or a bad response
    hit = (torch.rand(n, longest, generator=gen) < follow[:, None]).tolist()
    draws = torch.randint(0, shape.vocab, (n, longest + 1), generator=gen).tolist()
    sequences, rewards, noise = [], [], []
    for i, length in enumerate(lengths):
        tokens = [draws[i][0]]  # the prompt token
        for t in range(length):  # follow the pattern, or a random token
            tokens.append((tokens[-1] + 1) % shape.vocab if hit[i][t] else draws[i][t + 1])
        sequences.append(torch.tensor(tokens))
        rewards.append(sum(hit[i][:length]) / length)
        noise.append(0.15 * torch.randn(length, generator=gen, dtype=DTYPE))
    reward = torch.tensor(rewards, dtype=DTYPE)
    advantages = (reward - reward.mean()) / (reward.std() + 1e-6)  # GRPO-style group normalization
    return MiniBatch(sequences=sequences, advantages=advantages, noise=noise)


class Policy(torch.nn.Module):
    """Next-token policy over a tiny vocabulary: embedding -> MLP -> logits."""

    def __init__(self, shape: Shape, *, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(shape.vocab, shape.hidden)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(shape.hidden, shape.hidden),
            torch.nn.Tanh(),
            torch.nn.Linear(shape.hidden, shape.vocab),
        )
        self.to(DTYPE)

    def forward(self, context: torch.Tensor) -> torch.Tensor:
        """Log-probabilities over the next token, (tokens, vocab)."""
        return torch.log_softmax(self.mlp(self.embed(context)), dim=-1)
