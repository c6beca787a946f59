"""The books and what they share. One module per book -- ``effect``, ``cause``, ``price_book``,
``agreement``, and the cost book in ``efficiency/`` (the seed's package, its import paths the
contract) -- above the estimators they read: ``ledger/`` (step samples, the feature basis, the
unpaired and paired ledgers), ``efficiency/metric`` (G), ``efficiency/iproj`` (the I-projection),
``efficiency/shapley``; ``decisions`` makes the run's decisions once for every book."""
