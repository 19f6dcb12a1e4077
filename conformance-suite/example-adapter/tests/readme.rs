//! The suite's README shows this crate's files; they must be these files, byte for byte.

const README: &str = include_str!("../../README.md");

#[test]
fn readme_shows_this_crates_files() {
    for (name, text) in [
        ("Cargo.toml", include_str!("../Cargo.toml")),
        ("src/lib.rs", include_str!("../src/lib.rs")),
        (
            "src/bin/thirdparty-worker.rs",
            include_str!("../src/bin/thirdparty-worker.rs"),
        ),
        ("tests/suite.rs", include_str!("suite.rs")),
    ] {
        assert!(
            README.contains(text),
            "conformance-suite/README.md does not show {name} as it is; copy it there again"
        );
    }
}
