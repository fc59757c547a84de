"""How batches are made: plan (pure) -> execute (threads) -> batch slots -> pop."""
