"""Apply: merge a model's sketched edit (elision markers, SEARCH/REPLACE, unified diff, whole
file) into a file exactly. Entry point: `codeplane.apply.service.apply_edit`."""
