//! A forced release is one warning in the logs, on every backend: the one
//! `lease_core::Instrumented` writes for every coordinator that `fenced::connect` builds, naming
//! the key, the actor and the reason. An adapter must not log its own as well (three of them
//! once did, so each forced release showed twice). The same for a forced release of a free key.
//! A refused one (`expect_token` naming another holder) is one warning too, written by
//! `ForceRelease::refused`; so is a removal with no holder to report (an error, which the
//! wrapper does not log), written by `ForceRelease::removed_without_holder`.
//!
//! Each backend's server is started by the harness as for the suite; without one the backend is
//! a named skip, and a failure under `CI=true`.

use conformance_tests::logs::CapturedLogs;
use conformance_tests::subjects::subject_for;
use lease_core::{ForceRelease, LeaseOptions, LockKey, Token};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forced_release_is_one_warning_on_every_backend() {
    let logs = CapturedLogs::install(tracing::Level::WARN);

    for backend in ["memory", "redis", "etcd", "zookeeper", "consul"] {
        let Some(subject) = subject_for(backend, None)
            .await
            .unwrap_or_else(|e| panic!("{backend}: {e}"))
        else {
            // A named skip, reported by the harness.
            continue;
        };
        let client = (subject.connect)().await.expect("connects");
        let key = LockKey::new(format!("logs/{backend}/{:08x}", rand::random::<u32>())).unwrap();
        let options = LeaseOptions::new(subject.ttl);

        // Each call's actor is its own, so each call's lines are told apart.
        let held = client.acquire(&key, &options).await.expect("acquires");
        let actor = format!("{backend}-forcer");
        let request = ForceRelease::new(&actor, "count the warnings").unwrap();
        let removed = client.force_release(&key, &request).await.expect("forces");
        assert_eq!(removed.map(|h| h.token), Some(held.token()), "{backend}");
        let lines = logs.lines_with(&actor);
        assert_eq!(
            lines.len(),
            1,
            "{backend}: a forced release logged {lines:#?}"
        );
        assert!(lines[0].contains("WARN"), "{backend}: {}", lines[0]);
        assert!(lines[0].contains(key.as_str()), "{backend}: {}", lines[0]);

        let actor = format!("{backend}-free");
        let request = ForceRelease::new(&actor, "count the warnings").unwrap();
        let removed = client.force_release(&key, &request).await.expect("forces");
        assert!(removed.is_none(), "{backend}: the key was free");
        let lines = logs.lines_with(&actor);
        assert_eq!(
            lines.len(),
            1,
            "{backend}: a free key's release logged {lines:#?}"
        );

        let other = client
            .acquire(&key, &options)
            .await
            .expect("acquires again");
        let wrong = Token::new(other.token().get() + 1).unwrap();
        let actor = format!("{backend}-refused");
        let request = ForceRelease::new(&actor, "count the warnings")
            .unwrap()
            .expect_token(wrong);
        let refused = client.force_release(&key, &request).await;
        assert!(
            matches!(refused, Err(lease_core::Error::HolderChanged { .. })),
            "{backend}: {refused:?}"
        );
        let lines = logs.lines_with(&actor);
        assert_eq!(lines.len(), 1, "{backend}: a refusal logged {lines:#?}");
        other.release().await.expect("releases");
        drop(held);
        drop(subject);
    }
}
