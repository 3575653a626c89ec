"""Copy drills: random token runs written twice, the loss on the second copy only.

A held-out grounded question is answered only by copying the quoted entry from the prompt,
and three full-budget targets on grounded corpora never started to (held-out grounded token
accuracy stayed at the closed-book baseline). On a tiny model of the same architecture,
this bare drill (`a SEP a`, nothing else to predict) made an induction circuit appear within
a few hundred steps, while the same copying inside chat conversations did not. So a target
can spend its first steps on drills and meet the corpus with the circuit already built.

Each drill: `a <|im_start|> a <|im_end|>`, a of random length drawn uniformly from
[min_len, max_len] over the non-special ids; its loss start is the first token of the
second copy, so the random half (unpredictable by design) adds no gradient.
"""

from __future__ import annotations

import torch


def copy_drills(
    count: int,
    token_ids: list[int],
    separator_id: int,
    end_id: int,
    lengths: tuple[int, int],
    seed: int,
) -> tuple[list[list[int]], list[int]]:
    """(sequences, loss_starts): `count` drills over `token_ids`; loss_starts[i] is the index
    of the first token of drill i's second copy."""
    generator = torch.Generator().manual_seed(seed)
    pool = torch.tensor(token_ids)
    low, high = lengths
    sizes = torch.randint(low, high + 1, (count,), generator=generator).tolist()
    sequences, starts = [], []
    for size in sizes:
        run = pool[torch.randint(len(pool), (size,), generator=generator)].tolist()
        sequences.append([*run, separator_id, *run, end_id])
        starts.append(size + 1)
    return sequences, starts
