"""One batch's step on a rank, as named functions: open, materialize, agree, release, engine,
then one pure ``decide`` and, on the leader only, ``render``. ``batch.BatchRunner`` runs them."""
