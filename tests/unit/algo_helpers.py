"""Small shared helpers of the algorithm unit tests: float64 tensors from literals, elementwise
comparison against hand-computed lists, and two fake ranks for the cross-rank statistics."""

import threading

import torch


def t(rows):
    return torch.tensor(rows, dtype=torch.float64)


def ids(values):
    return torch.tensor(values, dtype=torch.long)


def close(actual, expected, rel=1e-6, abs=1e-9):
    """actual (a tensor) equals the nested list `expected` elementwise."""
    torch.testing.assert_close(actual.double(), torch.tensor(expected, dtype=torch.float64), rtol=rel, atol=abs)


class TwoRankGroup:
    """Two fake ranks in two threads; each rank's comm sums / concatenates both ranks' tensors."""

    def __init__(self):
        self.barrier = threading.Barrier(2, timeout=10)
        self.slots = [None, None]

    def comm(self, rank):
        group = self

        class _Comm:
            def _exchange(self, x):
                group.slots[rank] = x
                group.barrier.wait()
                both = list(group.slots)
                group.barrier.wait()
                return both

            def all_sum(self, x):
                a, b = self._exchange(x)
                return a + b

            def all_gather(self, x):
                return torch.cat(self._exchange(x))

        return _Comm()

    def run(self, fn, args0, args1):
        results, errors = [None, None], []

        def work(rank, args):
            try:
                results[rank] = fn(*args, comm=self.comm(rank))
            except Exception as e:  # noqa: BLE001 - surfaced below
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=work, args=(r, a)) for r, a in ((0, args0), (1, args1))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if errors:
            raise errors[0]
        return results
