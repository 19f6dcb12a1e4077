//! A Redis primary with two replicas and three Sentinels the harness runs (see [`super::cluster`]).
