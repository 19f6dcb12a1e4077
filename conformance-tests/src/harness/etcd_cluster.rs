//! A three-member etcd cluster the harness runs (see [`super::cluster`]).
