"""An objective that raises (a key the micro-batch does not hold)."""


def broken(model, micro):
    return micro["no such key"], 1
