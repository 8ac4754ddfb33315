"""The Spark SQL functions an expression in a spec may call: an allowlist, and why the rest are not.

Made from Spark 4.3's registry of built-in functions (``FunctionRegistry.builtin``) and
reviewed by group: ``tests/integration/test_spark_sql_parse.py`` fails when a Spark upgrade
adds a function this module does not place (allowed, or refused with a reason), or when an
allowed one is an aggregate or window function there. A function that is not on the list
(a user-defined one, one of a newer Spark, a catalog function) is refused: the guard can only
vouch for what it has reviewed.

Refused with their reasons: the ones that reach beyond the message on the Spark host (Java
calls; the XML, Avro and Protobuf functions, whose options name files and URLs the host
opens: ``rowValidationXSDPath``, ``avroSchemaUrl``, a descriptor file), and aggregate and
window functions (an expression reads one message; one of those would fold a batch).
The XPath functions stay: Spark's XPath reader expands no external entity (tested there).
"""

from __future__ import annotations

from conveyor.core.spark_sql.spark_sql_lexer import words

ALLOWED_FUNCTIONS = words(
    """
    abs acos acosh add_months aes_decrypt aes_encrypt aggregate and approx_top_k_estimate
    array array_append array_compact array_contains array_distinct array_except array_insert
    array_intersect array_join array_max array_min array_position array_prepend array_remove
    array_repeat array_size array_sort array_union arrays_overlap arrays_zip ascii asin
    asinh assert_true atan atan2 atanh base64 between bigint bin binary bit_count bit_get
    bit_length bitmap_bit_position bitmap_bucket_number bitmap_count boolean bround btrim
    cardinality cast cbrt ceil ceiling char char_length character_length chr coalesce
    collate collation concat concat_ws contains conv convert_timezone cos cosh cot crc32 csc
    curdate current_catalog current_database current_date current_path current_schema
    current_time current_timestamp current_timezone current_user date date_add date_diff
    date_format date_from_unix_date date_part date_sub date_trunc dateadd datediff datepart
    day dayname dayofmonth dayofweek dayofyear decimal decode degrees div double e
    element_at elt encode endswith equal_null exists exp explode explode_outer expm1 extract
    factorial filter find_in_set flatten float floor forall format_number format_string
    from_base32 from_csv from_json from_unixtime from_utc_timestamp get get_json_object
    getbit greatest hash hex hll_sketch_estimate hll_union hmac hour hypot if ifnull ilike
    in initcap inline inline_outer input_file_block_length input_file_block_start
    input_file_name instr int is_valid_utf8 is_valid_variant is_variant_null isnan isnotnull
    isnull jaro_winkler_similarity json_array_length json_object_keys json_tuple
    kll_sketch_get_n_bigint kll_sketch_get_n_double kll_sketch_get_n_float
    kll_sketch_get_quantile_bigint kll_sketch_get_quantile_double
    kll_sketch_get_quantile_float kll_sketch_get_rank_bigint kll_sketch_get_rank_double
    kll_sketch_get_rank_float kll_sketch_merge_bigint kll_sketch_merge_double
    kll_sketch_merge_float kll_sketch_to_string_bigint kll_sketch_to_string_double
    kll_sketch_to_string_float last_day lcase least left len length levenshtein like ln
    localtime localtimestamp locate log log10 log1p log2 lower lpad ltrim luhn_check
    make_date make_dt_interval make_interval make_time make_timestamp make_timestamp_ltz
    make_timestamp_ntz make_valid_utf8 make_ym_interval map map_concat map_contains_key
    map_entries map_filter map_from_arrays map_from_entries map_keys map_values map_zip_with
    mask md5 minute mod monotonically_increasing_id month monthname months_between
    named_struct nanvl negative next_day not now nullif nullifzero nvl nvl2 octet_length or
    overlay parse_json parse_url pi pmod posexplode posexplode_outer position positive pow
    power printf quarter quote radians raise_error rand randn random randstr reduce regexp
    regexp_count regexp_extract regexp_extract_all regexp_instr regexp_like regexp_replace
    regexp_substr repeat replace reverse right rint rlike round rpad rtrim schema_of_csv
    schema_of_json schema_of_variant sec second sentences sequence session_user
    session_window sha sha1 sha2 shiftleft shiftright shiftrightunsigned shuffle sign signum
    sin sinh size slice smallint sort_array soundex space spark_partition_id split
    split_part sqrt st_asbinary st_geogfromwkb st_geomfromwkb st_setsrid st_srid stack
    startswith str_to_map string struct substr substring substring_index tan tanh
    theta_difference theta_intersection theta_sketch_estimate theta_union time time_bucket
    time_diff time_from_micros time_from_millis time_from_seconds time_to_micros
    time_to_millis time_to_seconds time_trunc timestamp timestamp_micros timestamp_millis
    timestamp_nanos timestamp_seconds tinyint to_base32 to_binary to_char to_csv to_date
    to_json to_number to_time to_timestamp to_timestamp_ltz to_timestamp_ntz
    to_unix_timestamp to_utc_timestamp to_varchar to_variant_object transform transform_keys
    transform_values translate trim trunc try_add try_aes_decrypt try_divide try_element_at
    try_make_interval try_make_timestamp try_make_timestamp_ltz try_make_timestamp_ntz
    try_mod try_multiply try_parse_json try_parse_url try_subtract try_to_binary try_to_date
    try_to_number try_to_time try_to_timestamp try_url_decode try_validate_utf8
    try_variant_array_append try_variant_get try_variant_insert try_variant_set
    tuple_difference_double tuple_difference_integer tuple_difference_theta_double
    tuple_difference_theta_integer tuple_intersection_double tuple_intersection_integer
    tuple_intersection_theta_double tuple_intersection_theta_integer
    tuple_sketch_estimate_double tuple_sketch_estimate_integer tuple_sketch_summary_double
    tuple_sketch_summary_integer tuple_sketch_theta_double tuple_sketch_theta_integer
    tuple_union_double tuple_union_integer tuple_union_theta_double
    tuple_union_theta_integer typeof ucase unbase64 unhex uniform unix_date unix_micros
    unix_millis unix_nanos unix_seconds unix_timestamp upper url_decode url_encode user uuid
    validate_utf8 variant_array_append variant_delete variant_get variant_insert variant_set
    variant_strip_nulls vector_cosine_similarity vector_inner_product vector_l2_distance
    vector_norm vector_normalize version weekday weekofyear when width_bucket window
    window_time xpath xpath_boolean xpath_double xpath_float xpath_int xpath_long
    xpath_number xpath_short xpath_string xxhash64 year zeroifnull zip_with
    """
)

REFUSED_FUNCTIONS: dict[str, str] = {
    "reflect": "calls Java methods on the Spark host",
    "java_method": "calls Java methods on the Spark host",
    "try_reflect": "calls Java methods on the Spark host",
    "from_xml": "takes options that make the Spark host open a file (rowValidationXSDPath)",
    "schema_of_xml": "takes options that make the Spark host open a file (rowValidationXSDPath)",
    "to_xml": "takes the XML options, which name files on the Spark host",
    "from_avro": "can read a schema from a file or URL on the Spark host (avroSchemaUrl)",
    "to_avro": "can read a schema from a file or URL on the Spark host (avroSchemaUrl)",
    "schema_of_avro": "can read a schema from a file or URL on the Spark host (avroSchemaUrl)",
    "from_protobuf": "reads a descriptor file on the Spark host",
    "to_protobuf": "reads a descriptor file on the Spark host",
}

AGGREGATE_FUNCTIONS = words(
    """
    any any_value approx_count_distinct approx_percentile approx_top_k
    approx_top_k_accumulate approx_top_k_combine array_agg avg bit_and bit_or bit_xor
    bitmap_and_agg bitmap_construct_agg bitmap_or_agg bool_and bool_or collect_list
    collect_set collect_union corr count count_if count_min_sketch covar_pop covar_samp
    every first first_value grouping grouping_id histogram_numeric hll_sketch_agg
    hll_union_agg kll_merge_agg_bigint kll_merge_agg_double kll_merge_agg_float
    kll_sketch_agg_bigint kll_sketch_agg_double kll_sketch_agg_float kurtosis last
    last_value listagg max max_by mean measure median min min_by mode percentile
    percentile_approx percentile_cont percentile_disc regr_avgx regr_avgy regr_count
    regr_intercept regr_r2 regr_slope regr_sxx regr_sxy regr_syy schema_of_variant_agg
    skewness some std stddev stddev_pop stddev_samp string_agg sum theta_intersection_agg
    theta_sketch_agg theta_union_agg try_avg try_sum tuple_intersection_agg_double
    tuple_intersection_agg_integer tuple_sketch_agg_double tuple_sketch_agg_integer
    tuple_union_agg_double tuple_union_agg_integer var_pop var_samp variance vector_avg
    vector_sum
    """
)

WINDOW_FUNCTIONS = words(
    """
    counter_diff cume_dist dense_rank lag lead nth_value ntile percent_rank rank row_number

    """
)


def function_problem(name: str) -> str | None:
    """Why the function ``name`` (lower case, as called) may not be called, or None."""
    if name in ALLOWED_FUNCTIONS:
        return None
    if name in REFUSED_FUNCTIONS:
        return f"function {name}() is not allowed: it {REFUSED_FUNCTIONS[name]}"
    if name in AGGREGATE_FUNCTIONS or name in WINDOW_FUNCTIONS:
        kind = "an aggregate" if name in AGGREGATE_FUNCTIONS else "a window function"
        return f"function {name}() is not allowed: {kind} (an expression reads one message)"
    return (
        f"function {name}() is not allowed: not one of Spark's built-in functions this "
        "version of Conveyor reviewed (docs/OPERATIONS.md, 'Spark SQL in a spec')"
    )
