"""Step samples and ledgers: the features of each step's rollouts in a declared basis
(``basis``, ``features``), the unpaired ledger and the reading of a record into step samples
(``price``: the seed's module name, kept as the contract), and the paired ledger (``paired``)."""
