//! A three-server ZooKeeper ensemble the harness runs (see [`super::cluster`]).
