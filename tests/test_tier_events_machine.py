"""Cache events of a shard with a host tier (akv.testing.tier_events_machine): pending and failing copies, metadata mode."""

from akv.testing.tier_events_machine import SyncTierEventsMachine, TierEventsMachine

TestTierEventsMachine = TierEventsMachine.TestCase
TestSyncTierEventsMachine = SyncTierEventsMachine.TestCase
