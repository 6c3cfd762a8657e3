"""What every stage shares: named registries, hashes, atomic writes, bounded network and process-group waits."""
